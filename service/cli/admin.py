"""`grpo admin ...`: tenants and API keys."""

from __future__ import annotations

import typer

app = typer.Typer(help="Administration: tenants and API keys.", no_args_is_help=True)
