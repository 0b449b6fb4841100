"""The systems under comparison, each started as child processes on this machine and stopped in
teardown: splitserve disaggregated and aggregated (`splitserve up`) and the peers: vLLM's CPU
build (its own venv, `make peers`) and `transformers serve --continuous-batching`.

The sweep's main thread owns every process started here; one system runs at a time, so each has
the machine's cores to itself (the load generator shares them).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.compare.machine import cores
from bench.compare.vllm_peer import VLLM_VENV, vllm_command, vllm_env, vllm_settings_note
from bench.run_settings import Override, RunSettings, gateway_override, with_inherited
from splitserve_cli.processes import free_port

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ServeOptions:
    """What every system is started with, so they all run the same arithmetic on the same
    cores. `dtype` goes to splitserve's workers (SPLITSERVE_DTYPE, which `splitserve up` passes
    on) and to `transformers serve --dtype`; "auto", the default, is splitserve's shipped dtype
    (bfloat16 on a CPU with native bfloat16 dot products, AVX512-BF16 or AMX; engine/config.py),
    and the peer then runs what it resolves to.

    Threads: splitserve up splits the cores between its workers (disaggregated: 1 torch thread
    each for prefill and decode on 2 cores; aggregated: 2 for the one worker); the peer gets
    the same total, `peer_threads` (0: all the cores), as OMP_NUM_THREADS. The issue author's
    peer reference numbers used bf16 and 4096 blocks of 16."""

    dtype: str = "auto"
    dtype_reason: str = ""  # why the sweep runs `dtype` rather than the shipped "auto"
    peer_dtype: str = ""  # "": the same as dtype
    cb_num_blocks: int = 4096
    cb_block_size: int = 16
    cb_max_batch_tokens: int = 0  # 0: transformers' own default
    peer_threads: int = 0
    # The gateway's early rejection (503 when the predicted TTFT exceeds this; 0: off). None:
    # the shipped default, so the sweep measures what `make run` serves, refusals included.
    gateway_ttft_target_s: float | None = None

    def peer_omp_threads(self) -> int:
        return self.peer_threads or cores()


def serve_settings(opts: ServeOptions, systems: tuple[str, ...] | None = None) -> RunSettings:
    """What splitserve runs with in the sweep, against what ships (`make run`: `splitserve up`
    with no flags): the gateway's admission and the workers' dtype; the note says how the peers
    among `systems` (None: all) are configured."""
    overrides: tuple[Override, ...] = ()
    if opts.gateway_ttft_target_s is not None:
        overrides += (gateway_override("ttft_target_s", opts.gateway_ttft_target_s,
                                       "--gateway-ttft-target-s given"),)
    if opts.dtype != "auto":
        overrides += (Override("workers", "SPLITSERVE_DTYPE", opts.dtype,
                               "auto (bfloat16 where the CPU multiplies it natively, else float32)",
                               opts.dtype_reason or "--dtype given"),)
    return RunSettings("bench.compare", with_inherited(overrides),
                       note=peer_settings_note(opts, systems))


def peer_settings_note(opts: ServeOptions, peers: tuple[str, ...] | None = None) -> str:
    """How each peer in the sweep is configured (its changes from its own defaults, and why);
    `peers` None: all of them."""
    notes = {
        "vllm": vllm_settings_note(opts.peer_dtype or opts.dtype, opts.peer_omp_threads()),
        "transformers-serve": (
            f"transformers serve: --dtype {opts.peer_dtype or opts.dtype}, "
            f"OMP_NUM_THREADS {opts.peer_omp_threads()}, "
            f"{opts.cb_num_blocks} blocks of {opts.cb_block_size}; "
            "it has no admission control and refuses nothing"),
        "splitserve-disagg-fixed": (
            "splitserve disaggregated, fixed halves: `splitserve up --no-core-share`, not the "
            "shipped default; each worker keeps to its half of the cores even while the other "
            "is idle, the baseline the core share is measured against"),
        "splitserve-disagg-noyield": (
            "splitserve disaggregated, decode never pauses: SPLITSERVE_CORE_SHARE_YIELD=0, not "
            "the shipped default; the decode worker keeps stepping on its own core while the "
            "prefill worker steps, the baseline prompts-first is measured against"),
        "splitserve-disagg-burst1": (
            "splitserve disaggregated, decode pauses up to 1 s at once: "
            "SPLITSERVE_CORE_SHARE_YIELD_BURST_S=1, a candidate default measured beside the "
            "shipped 0.5 s"),
        "splitserve-agg-noprefault": (
            "splitserve aggregated, KV pages faulted in by the steps that write them: "
            "SPLITSERVE_CPU_KV_PREFAULT_TOKENS=0, not the shipped default; the baseline the "
            "idle-time prefault (engine/kv_prefault.py) is measured against"),
        "splitserve-agg-noshared": (
            "splitserve aggregated, every decode row reads its whole context: "
            "SPLITSERVE_CPU_SHARED_PREFIX_ATTENTION=off, not the shipped default; the baseline "
            "the shared-prefix decode attention (kernels/cpu/shared_prefix_decode.h) is measured "
            "against"),
        "splitserve-disagg-noshared": (
            "splitserve disaggregated, every decode row reads its whole context: "
            "SPLITSERVE_CPU_SHARED_PREFIX_ATTENTION=off, not the shipped default"),
    }
    return " || ".join(text for name, text in notes.items() if peers is None or name in peers)


@dataclass(frozen=True)
class SystemSpec:
    name: str
    label: str
    flavor: str  # how loadgen asks it for exact output lengths
    probe: str = "/health"  # answers 200 once the system serves
    probe_port_offset: int = 0  # splitserve: /ready is on the admin port, `up`'s --port + 1
    startup_timeout_s: float = 300.0
    installed_by: str = ""  # the make target that installs it, where the main venv lacks it
    up_flags: tuple[str, ...] = ()  # splitserve: `splitserve up` flags beyond the defaults
    extra_env: tuple[tuple[str, str], ...] = ()  # splitserve: settings beyond the defaults
    ablation: bool = False  # not shipped: a default turned off, run only when named

    def installed(self) -> bool:
        return self.name != "vllm" or (VLLM_VENV / "bin" / "python").exists()

    def env(self, opts: ServeOptions) -> dict[str, str]:
        """The environment it is started with beyond this process's own."""
        if self.name.startswith("splitserve-"):
            # splitserve up sets each worker's OMP_NUM_THREADS itself (the cores split between them).
            return {"SPLITSERVE_DTYPE": opts.dtype, **serve_settings(opts).gateway_env(),
                    **dict(self.extra_env)}
        if self.name == "vllm":
            return vllm_env(VLLM_VENV, opts.peer_omp_threads())
        threads = str(opts.peer_omp_threads())
        return {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}

    def command(self, model_dir: str, port: int, opts: ServeOptions) -> list[str]:
        if self.name.startswith("splitserve-"):
            mode = self.name.removeprefix("splitserve-").split("-")[0]
            return [sys.executable, "-m", "splitserve_cli.main", "up", "--mode", mode,
                    "--port", str(port), "--model", model_dir, *self.up_flags]
        if self.name == "vllm":
            return vllm_command(VLLM_VENV, model_dir, port, opts.peer_dtype or opts.dtype)
        return [str(Path(sys.executable).with_name("transformers")), "serve",
                "--continuous-batching", "--device", "cpu",
                "--dtype", opts.peer_dtype or opts.dtype,
                "--cb-num-blocks", str(opts.cb_num_blocks),
                "--cb-block-size", str(opts.cb_block_size),
                *(["--cb-max-batch-tokens", str(opts.cb_max_batch_tokens)]
                  if opts.cb_max_batch_tokens else []),
                "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", model_dir]


def _splitserve(name: str, label: str, **kwargs) -> SystemSpec:
    """A `splitserve up` deployment: OpenAI API, ready once the admin port's /ready says so."""
    return SystemSpec(name, label, "openai", probe="/ready", probe_port_offset=1, **kwargs)


SYSTEMS = {
    s.name: s for s in (
        _splitserve("splitserve-disagg", "splitserve disaggregated"),
        _splitserve("splitserve-agg", "splitserve aggregated"),
        # Not shipped: disaggregated with each worker held to its half of the cores, the
        # baseline of the core share (services/common/core_share.py), measured beside it.
        _splitserve("splitserve-disagg-fixed", "splitserve disaggregated, fixed halves "
                    "(--no-core-share)", up_flags=("--no-core-share",), ablation=True),
        # Not shipped: the core share without prompts first (decode never pauses for the
        # prefill worker's steps), measured beside the default.
        _splitserve("splitserve-disagg-noyield", "splitserve disaggregated, decode never pauses "
                    "(yield 0)", extra_env=(("SPLITSERVE_CORE_SHARE_YIELD", "0"),), ablation=True),
        _splitserve("splitserve-disagg-burst1", "splitserve disaggregated, pauses up to 1 s "
                    "(yield burst 1 s)", extra_env=(("SPLITSERVE_CORE_SHARE_YIELD_BURST_S", "1"),), ablation=True),
        # Not shipped: no idle-time prefault of the KV pool's pages, measured beside the default.
        _splitserve("splitserve-agg-noprefault", "splitserve aggregated, no KV prefault",
                    extra_env=(("SPLITSERVE_CPU_KV_PREFAULT_TOKENS", "0"),), ablation=True),
        # Not shipped: no shared-prefix decode attention, measured beside the default.
        _splitserve("splitserve-agg-noshared", "splitserve aggregated, no shared-prefix attention",
                    extra_env=(("SPLITSERVE_CPU_SHARED_PREFIX_ATTENTION", "off"),), ablation=True),
        _splitserve("splitserve-disagg-noshared", "splitserve disaggregated, no shared-prefix "
                    "attention", extra_env=(("SPLITSERVE_CPU_SHARED_PREFIX_ATTENTION", "off"),), ablation=True),
        # Not shipped: the gateway's TPOT target off (no pace limit on decode workers),
        # measured beside the default.
        _splitserve("splitserve-agg-nopace", "splitserve aggregated, no TPOT target",
                    extra_env=(("SPLITSERVE_GATEWAY_TPOT_TARGET_S", "0"),), ablation=True),
        _splitserve("splitserve-disagg-nopace", "splitserve disaggregated, no TPOT target",
                    extra_env=(("SPLITSERVE_GATEWAY_TPOT_TARGET_S", "0"),), ablation=True),
        # About 90 s of start-up here (it compiles its kernels), more on a loaded machine.
        SystemSpec("vllm", "vLLM (CPU)", "openai", startup_timeout_s=420.0,
                   installed_by="make peers"),
        SystemSpec("transformers-serve", "transformers serve (CB)", "transformers"),
    )
}


@dataclass
class RunningSystem:
    spec: SystemSpec
    url: str
    model_name: str
    process: subprocess.Popen
    log_path: Path
    command: list[str]  # as run, for the report (environment overrides first)

    def stop(self, timeout_s: float = 45.0) -> None:
        """SIGTERM (splitserve up then stops its gateway and workers itself), SIGKILL if it
        outlives the timeout."""
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _wait_ready(spec: SystemSpec, process: subprocess.Popen, url: str, log_path: Path,
                timeout_s: float, progress_every_s: float = 15.0) -> None:
    """Polls the probe until it answers 200; every `progress_every_s` prints how long it has
    waited and the log's last line, so a slow start (vLLM compiles for about 90 s) shows life."""
    base, _, port = url.rpartition(":")
    probe = f"{base}:{int(port) + spec.probe_port_offset}{spec.probe}"
    start = time.monotonic()
    shown = start
    while (waited := time.monotonic() - start) < timeout_s:
        if process.poll() is not None:
            raise RuntimeError(f"{spec.name} exited with code {process.returncode}:\n"
                               f"{_log_tail(log_path)}")
        try:
            if httpx.get(probe, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() - shown >= progress_every_s:
            shown = time.monotonic()
            last = _log_tail(log_path, 1).strip()[:120]
            print(f"  {spec.name}: not ready after {waited:.0f} s of {timeout_s:.0f} s"
                  + (f"; log: {last}" if last else ""), flush=True)
        time.sleep(0.5)
    raise RuntimeError(f"{spec.name} was not ready at {probe} in {timeout_s:.0f} s:\n"
                       f"{_log_tail(log_path)}")


def _free_port_with_next(tries: int = 50) -> int:
    """A free port whose next one is free too: `splitserve up` puts the gateway's admin
    listener on --port + 1, and a random free port's neighbour may be taken (a run once lost
    its aggregated deployment to that)."""
    for _ in range(tries):
        port = free_port()
        if port >= 65535:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free pair of adjacent ports")


def start_system(spec: SystemSpec, model_dir: str, log_dir: Path,
                 opts: ServeOptions = ServeOptions(),
                 startup_timeout_s: float | None = None) -> RunningSystem:
    if not spec.installed():
        raise RuntimeError(f"{spec.name} is not installed here; `{spec.installed_by}` installs it")
    port = _free_port_with_next() if spec.probe_port_offset else free_port()
    command = spec.command(model_dir, port, opts)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{spec.name}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    overrides = spec.env(opts)
    env.update(overrides)
    shown = [f"{k}={v}" for k, v in overrides.items()]  # for the report
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, cwd=REPO, env=env,
                                   start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    running = RunningSystem(spec, url, model_dir, process, log_path, shown + command)
    try:
        _wait_ready(spec, process, url, log_path, startup_timeout_s or spec.startup_timeout_s)
        if spec.flavor == "openai":  # splitserve and vLLM: the name they serve it under
            running.model_name = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        # transformers serve is pinned to the path it was given and wants exactly that name.
    except BaseException:
        running.stop()
        raise
    return running
