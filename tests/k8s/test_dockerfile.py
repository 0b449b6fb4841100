"""The Dockerfile, checked without a Docker engine: its stages, the torch build each variant
installs (pyproject's pin, CPU or CUDA index), a non-root user the chart agrees with, and a build
context that cannot carry secrets in."""

from __future__ import annotations

import fnmatch
import re
import shlex
import subprocess
import tomllib
from dataclasses import dataclass

import pytest
import yaml
from chart_render import CHART_DIR, REPO_ROOT

DOCKERFILE = REPO_ROOT / "Dockerfile"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    stage: str | None  # None before the first FROM


def parse_dockerfile(text: str) -> list[Instruction]:
    """Docker's line rules: `\\` continues a line, comment lines vanish (inside continuations too)."""
    instructions, stage, pending = [], None, ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        pending = ""
        keyword = keyword.upper()
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", args.strip(), re.IGNORECASE)
            stage = match.group(2) if match else args.strip()
        instructions.append(Instruction(keyword, args.strip(), stage))
    assert not pending, "the Dockerfile ends inside a continued line"
    return instructions


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text())


def stage_of(instructions: list[Instruction], name: str) -> list[Instruction]:
    return [i for i in instructions if i.stage == name]


def args_of(stage: list[Instruction]) -> dict[str, str | None]:
    found = {}
    for i in stage:
        if i.keyword == "ARG":
            name, _, default = i.args.partition("=")
            found[name] = default or None
    return found


def torch_pin() -> str:
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    (pin,) = [d for d in pyproject["project"]["dependencies"] if d.startswith("torch==")]
    return pin.removeprefix("torch==")


def chart_values() -> dict:
    return yaml.safe_load((CHART_DIR / "values.yaml").read_text())


def test_parser_joins_continuations_and_drops_comments() -> None:
    parsed = parse_dockerfile("FROM a:1 AS x\n# note\nRUN one \\\n# gone\n  two\nUSER 5\n")
    assert [(i.keyword, i.args, i.stage) for i in parsed] == [
        ("FROM", "a:1 AS x", "x"), ("RUN", "one  two", "x"), ("USER", "5", "x")]


def test_stages_build_then_copy_into_a_slim_runtime(instructions) -> None:
    froms = [i for i in instructions if i.keyword == "FROM"]
    assert [i.stage for i in froms] == ["python-base", "build", "runtime"]
    base = froms[0].args.split()[0]
    # An external base pinned to an exact Python patch release, never a floating tag.
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", base), base
    assert [i.args.split()[0] for i in froms[1:]] == ["python-base", "python-base"]
    copies_from = [re.search(r"--from=(\S+)", i.args).group(1)
                   for i in instructions if i.keyword == "COPY" and "--from=" in i.args]
    assert copies_from == ["build"]
    runtime = stage_of(instructions, "runtime")
    assert not any("pip install" in i.args for i in runtime if i.keyword == "RUN")


def test_variant_is_a_build_arg_defaulting_to_cpu(instructions) -> None:
    global_args = args_of([i for i in instructions if i.stage is None])
    assert global_args == {"VARIANT": "cpu"}
    # An ARG before FROM is visible inside a stage only when the stage declares it again.
    for stage in ("build", "runtime"):
        assert "VARIANT" in args_of(stage_of(instructions, stage))


def _torch_install_for(instructions, variant: str) -> subprocess.CompletedProcess:
    """Runs the build stage's torch RUN line under /bin/sh with pip and python stubbed out."""
    build = stage_of(instructions, "build")
    (run,) = [i for i in build if i.keyword == "RUN" and "torch==" in i.args]
    arg_values = {k: v for k, v in args_of(build).items() if v is not None}
    arg_values["VARIANT"] = variant
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in arg_values.items())
    script = f'pip() {{ echo pip "$@"; }}; python() {{ :; }}; {exports}; {run.args}'
    return subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=30)


def test_cpu_variant_installs_the_pinned_torch_from_the_cpu_index(instructions) -> None:
    result = _torch_install_for(instructions, "cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "pip", "install", "--index-url", "https://download.pytorch.org/whl/cpu",
        f"torch=={torch_pin()}"]


def test_cuda_variant_installs_the_same_torch_from_a_cuda_index(instructions) -> None:
    result = _torch_install_for(instructions, "cuda")
    assert result.returncode == 0, result.stderr
    pip, install, flag, index, requirement = result.stdout.split()
    assert (pip, install, flag, requirement) == ("pip", "install", "--index-url",
                                                  f"torch=={torch_pin()}")
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d{3}", index), index


def test_unknown_variant_fails_the_build(instructions) -> None:
    result = _torch_install_for(instructions, "rocm")
    assert result.returncode != 0
    assert "VARIANT must be cpu or cuda" in result.stderr


def test_project_install_keeps_torch_and_builds_the_grpc_stubs(instructions) -> None:
    build = stage_of(instructions, "build")
    runs = [i.args for i in build if i.keyword == "RUN"]
    torch_step = next(n for n, r in enumerate(runs) if "torch==" in r)
    project_step = next(n for n, r in enumerate(runs) if "pip install ." in r)
    assert torch_step < project_step  # torch first, so the project install keeps that build
    assert "grpc_tools.protoc -Iprotos" in runs[project_step]
    assert "protos/splitserve/v1/*.proto" in runs[project_step]
    assert list((REPO_ROOT / "protos" / "splitserve" / "v1").glob("*.proto"))


def test_runs_as_the_non_root_user_the_chart_expects(instructions) -> None:
    runtime = stage_of(instructions, "runtime")
    users = [i.args for i in runtime if i.keyword == "USER"]
    assert users == ["10001:10001"]
    assert [i.keyword for i in runtime][-4:] == ["USER", "EXPOSE", "ENTRYPOINT", "CMD"]
    creates = " ".join(i.args for i in runtime if i.keyword == "RUN")
    assert "useradd --system --uid 10001 --gid 10001" in creates
    pod = chart_values()["podSecurityContext"]
    assert (pod["runAsUser"], pod["runAsGroup"], pod["runAsNonRoot"]) == (10001, 10001, True)


def test_caches_point_at_tmp_since_the_root_filesystem_is_read_only(instructions) -> None:
    env = " ".join(i.args for i in stage_of(instructions, "runtime") if i.keyword == "ENV")
    for name in ("HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        assert re.search(rf"\b{name}=/tmp\b", env), name
    assert chart_values()["securityContext"]["readOnlyRootFilesystem"] is True


def test_entrypoint_and_ports_match_the_cli_and_the_chart(instructions) -> None:
    runtime = stage_of(instructions, "runtime")
    (entrypoint,) = [i.args for i in runtime if i.keyword == "ENTRYPOINT"]
    assert entrypoint == '["splitserve"]'
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert "splitserve" in pyproject["project"]["scripts"]
    (expose,) = [i.args for i in runtime if i.keyword == "EXPOSE"]
    values = chart_values()
    expected = {values["gateway"]["httpPort"], values["gateway"]["grpcPort"],
                values["worker"]["grpcPort"], values["worker"]["kvPort"],
                values["worker"]["metricsPort"]}
    assert {int(p) for p in expose.split()} == expected


SECRET_NAME = re.compile(r"PASSWORD|PASSWD|SECRET|TOKEN|API_?KEY|ACCESS_KEY|PRIVATE|CREDENTIAL",
                         re.IGNORECASE)


def test_no_secret_is_baked_into_the_image(instructions) -> None:
    for i in instructions:
        if i.keyword in ("ARG", "ENV"):
            for name in re.findall(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)=", " " + i.args):
                assert not SECRET_NAME.search(name), i
        assert not re.search(r"://[^/\s:@]+:[^/\s@]+@", i.args), f"credentials in a URL: {i}"
        if i.keyword in ("COPY", "ADD"):
            assert i.keyword == "COPY", "ADD can fetch URLs and unpack archives; use COPY"
            for source in i.args.split()[:-1]:
                assert not re.search(r"\.env|\.pem|\.key|id_rsa|kube", source), i


def dockerignore_includes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern decides; `!` re-includes."""
    included = True
    for pattern in patterns:
        negated = pattern.startswith("!")
        bare = pattern.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, bare) or path.startswith(bare + "/") or \
                fnmatch.fnmatch(path, bare.replace("**/", "")) or \
                fnmatch.fnmatch(path.rsplit("/", 1)[-1], bare.replace("**/", "")):
            included = negated
    return included


def test_build_context_is_an_allow_list_of_what_copy_needs(instructions) -> None:
    patterns = [line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*", "the context must start from nothing and allow back what is needed"
    for secret in (".env", "deploy/.env", "id.pem", ".git/config", ".venv/bin/python",
                   "models/smollm2-135m-instruct/model.safetensors", "kubeconfig",
                   "services/gateway/NOTES_FROM_LEAD.md", "engine/__pycache__/x.pyc"):
        assert not dockerignore_includes(secret, patterns), secret
    sources = [s for i in instructions if i.keyword == "COPY" and "--from=" not in i.args
               for s in i.args.split()[:-1]]
    for source in sources:
        assert (REPO_ROOT / source).exists(), source
        assert dockerignore_includes(source.rstrip("/"), patterns), source
    # Every package the project installs (bench aside, which no process imports) is copied in.
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        if package != "bench" and (REPO_ROOT / package).is_dir():
            assert f"{package}/" in sources, package
