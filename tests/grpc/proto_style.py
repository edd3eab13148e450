"""A buf-lint-equivalent style check of proto files (the subset of STANDARD + COMMENTS we rely on).

Works on compiled descriptors (protoc with source info), not on text, so comments and names are exactly
what protoc saw. Each rule is named after its buf counterpart. `buf lint` itself runs too when a buf
binary is available (tests/grpc/test_proto_style.py); this checker keeps the rules enforced where it is not.
"""

from __future__ import annotations

import re
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc_tools
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

_PASCAL = re.compile(r"^[A-Z][A-Za-z0-9]*$")
_LOWER_SNAKE = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")
_UPPER_SNAKE = re.compile(r"^[A-Z][A-Z0-9]*(_[A-Z0-9]+)*$")
_FILE_NAME = re.compile(r"^[a-z][a-z0-9_]*\.proto$")
_VERSION = re.compile(r"^v\d+((alpha|beta)\d*)?$")

# FileDescriptorProto / DescriptorProto / EnumDescriptorProto / ServiceDescriptorProto field numbers
# used in SourceCodeInfo.Location.path.
_FILE_MESSAGE, _FILE_ENUM, _FILE_SERVICE = 4, 5, 6
_MSG_FIELD, _MSG_NESTED, _MSG_ENUM, _MSG_ONEOF = 2, 3, 4, 8
_ENUM_VALUE = 2
_SERVICE_METHOD = 2


def upper_snake(name: str) -> str:
    """PascalCase -> UPPER_SNAKE_CASE ("JobState" -> "JOB_STATE", "HTTPCode" -> "HTTP_CODE")."""
    name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name)
    name = re.sub(r"(?<=[A-Z])(?=[A-Z][a-z])", "_", name)
    return name.upper()


def compile_protos(proto_root: Path, files: list[str]) -> descriptor_pb2.FileDescriptorSet:
    """Compile `files` (relative to proto_root) to descriptors with comments. Raises on protoc errors."""
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "set.bin"
        well_known = Path(grpc_tools.__file__).parent / "_proto"
        code = protoc.main(
            [
                "protoc",
                f"--proto_path={proto_root}",
                f"--proto_path={well_known}",
                "--include_source_info",
                f"--descriptor_set_out={target}",
                *files,
            ]
        )
        if code != 0:
            raise RuntimeError(f"protoc failed on {files}")
        return descriptor_pb2.FileDescriptorSet.FromString(target.read_bytes())


def _comments(fd: descriptor_pb2.FileDescriptorProto) -> dict[tuple[int, ...], str]:
    return {tuple(loc.path): loc.leading_comments.strip() for loc in fd.source_code_info.location}


def _messages(
    messages: list[descriptor_pb2.DescriptorProto], path: tuple[int, ...]
) -> Iterator[tuple[descriptor_pb2.DescriptorProto, tuple[int, ...]]]:
    for i, message in enumerate(messages):
        here = (*path, i)
        if message.options.map_entry:
            continue  # synthesised by protoc for map<,> fields
        yield message, here
        yield from _messages(list(message.nested_type), (*here, _MSG_NESTED))


def check_file(fd: descriptor_pb2.FileDescriptorProto) -> list[str]:
    """Every rule violation of one file, as "file: RULE: what"."""
    problems: list[str] = []

    def bad(rule: str, what: str) -> None:
        problems.append(f"{fd.name}: {rule}: {what}")

    comments = _comments(fd)

    def need_comment(path: tuple[int, ...], rule: str, what: str) -> None:
        if not comments.get(path):
            bad(rule, f"{what} has no leading comment")

    directory, _, base = fd.name.rpartition("/")
    if not fd.package:
        bad("PACKAGE_DEFINED", "no package")
    if directory != fd.package.replace(".", "/"):
        bad("PACKAGE_DIRECTORY_MATCH", f"package {fd.package!r} is not in directory {directory!r}")
    if not _VERSION.match(fd.package.rpartition(".")[2]):
        bad("PACKAGE_VERSION_SUFFIX", f"package {fd.package!r} does not end in a version (v1)")
    if not _FILE_NAME.match(base):
        bad("FILE_LOWER_SNAKE_CASE", f"file name {base!r} is not lower_snake_case.proto")

    enums: list[tuple[descriptor_pb2.EnumDescriptorProto, tuple[int, ...]]] = [
        (e, (_FILE_ENUM, i)) for i, e in enumerate(fd.enum_type)
    ]
    for message, path in _messages(list(fd.message_type), (_FILE_MESSAGE,)):
        if not _PASCAL.match(message.name):
            bad("MESSAGE_PASCAL_CASE", f"message {message.name}")
        need_comment(path, "COMMENT_MESSAGE", f"message {message.name}")
        for j, field in enumerate(message.field):
            if not _LOWER_SNAKE.match(field.name):
                bad("FIELD_LOWER_SNAKE_CASE", f"field {message.name}.{field.name}")
            need_comment((*path, _MSG_FIELD, j), "COMMENT_FIELD", f"field {message.name}.{field.name}")
        for j, oneof in enumerate(message.oneof_decl):
            if oneof.name.startswith("_"):
                continue  # synthetic oneof of a proto3 `optional` field
            if not _LOWER_SNAKE.match(oneof.name):
                bad("ONEOF_LOWER_SNAKE_CASE", f"oneof {message.name}.{oneof.name}")
            need_comment((*path, _MSG_ONEOF, j), "COMMENT_ONEOF", f"oneof {message.name}.{oneof.name}")
        enums += [(e, (*path, _MSG_ENUM, j)) for j, e in enumerate(message.enum_type)]

    for enum, path in enums:
        prefix = upper_snake(enum.name)
        if not _PASCAL.match(enum.name):
            bad("ENUM_PASCAL_CASE", f"enum {enum.name}")
        need_comment(path, "COMMENT_ENUM", f"enum {enum.name}")
        zero = [v for v in enum.value if v.number == 0]
        if not zero or zero[0].name != f"{prefix}_UNSPECIFIED":
            bad("ENUM_ZERO_VALUE_SUFFIX", f"enum {enum.name}: the zero value must be {prefix}_UNSPECIFIED")
        for j, value in enumerate(enum.value):
            if not _UPPER_SNAKE.match(value.name):
                bad("ENUM_VALUE_UPPER_SNAKE_CASE", f"enum value {value.name}")
            if not value.name.startswith(f"{prefix}_"):
                bad("ENUM_VALUE_PREFIX", f"enum value {value.name} does not start with {prefix}_")
            need_comment((*path, _ENUM_VALUE, j), "COMMENT_ENUM_VALUE", f"enum value {value.name}")

    used = Counter(t.rpartition(".")[2] for s in fd.service for m in s.method for t in (m.input_type, m.output_type))
    for i, service in enumerate(fd.service):
        if not service.name.endswith("Service") or not _PASCAL.match(service.name):
            bad("SERVICE_SUFFIX", f"service {service.name} must be PascalCase ending in Service")
        need_comment((_FILE_SERVICE, i), "COMMENT_SERVICE", f"service {service.name}")
        for j, rpc in enumerate(service.method):
            need_comment((_FILE_SERVICE, i, _SERVICE_METHOD, j), "COMMENT_RPC", f"rpc {service.name}.{rpc.name}")
            if not _PASCAL.match(rpc.name):
                bad("RPC_PASCAL_CASE", f"rpc {rpc.name}")
            request, response = rpc.input_type.rpartition(".")[2], rpc.output_type.rpartition(".")[2]
            if request not in (f"{rpc.name}Request", f"{service.name}{rpc.name}Request"):
                bad("RPC_REQUEST_STANDARD_NAME", f"rpc {rpc.name} takes {request}, not {rpc.name}Request")
            if response not in (f"{rpc.name}Response", f"{service.name}{rpc.name}Response"):
                bad("RPC_RESPONSE_STANDARD_NAME", f"rpc {rpc.name} returns {response}, not {rpc.name}Response")
            for name in (request, response):
                if used[name] > 1:
                    bad("RPC_REQUEST_RESPONSE_UNIQUE", f"{name} is used by more than one rpc")
    return problems


def check_tree(proto_root: Path) -> list[str]:
    """Compile every .proto under proto_root and return all violations (empty = clean). `tinker_public/` is
    excluded, as in buf.yaml: it mirrors a third party's wire format."""
    files = sorted(
        str(p.relative_to(proto_root))
        for p in proto_root.rglob("*.proto")
        if "node_modules" not in p.parts and "tinker_public" not in p.parts
    )
    own = set(files)
    problems: list[str] = []
    for fd in compile_protos(proto_root, files).file:
        if fd.name in own:
            problems += check_file(fd)
    return problems
