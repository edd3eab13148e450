"""The API process must never import torch (nor transformers), not even transitively."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import service.app, cli, service.models, service.storage
service.app.create_app()
heavy = sorted(m for m in ("torch", "transformers", "peft", "safetensors") if m in sys.modules)
print(",".join(heavy))
"""


def test_importing_the_service_does_not_import_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"service imports {result.stdout.strip()}"
