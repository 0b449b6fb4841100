"""`splitserve up`: a whole local deployment (gateway + prefill + decode workers, or one
aggregated worker) as child processes of this one, stopped together on Ctrl-C or SIGTERM.

The launcher's main thread owns the children; one reader thread per child copies its output,
prefixed with its name, and spots its SPLITSERVE_READY line.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass

from services.common.addresses import check_port, check_ports_free
from services.common.core_share import host_cores

DEFAULT_MODEL = "models/smollm2-135m-instruct"
MODES = ("disagg", "agg")


@dataclass(frozen=True)
class UpConfig:
    port: int = 8000
    host: str = "127.0.0.1"
    model: str = DEFAULT_MODEL
    served_model_name: str = ""  # clients' name for the model (empty: the folder's)
    mode: str = "disagg"
    grpc_port: int = -1
    # The gateway's admin port (/metrics, /ready) on 127.0.0.1; 0: the gateway's default,
    # --port + 1 (any free port when --port is 0).
    admin_port: int = 0
    num_threads: int = 0  # torch threads per worker; 0 splits this machine's cores
    # disagg with the cores split: each worker lends its share to the other while idle.
    core_share: bool = True
    startup_timeout_s: float = 600.0
    stop_timeout_s: float = 15.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"--model {self.model!r} is not a model folder (run `make model`)")
        check_port("--port", self.port)
        check_port("--grpc-port", self.grpc_port, off=True)
        if not 0 <= self.admin_port <= 65535 or self.admin_listen_port > 65535:
            raise ValueError("--admin-port must be a port (0: --port + 1)")

    @property
    def admin_listen_port(self) -> int:
        """The gateway's admin port as it binds it (0: any free one)."""
        return self.admin_port or (self.port + 1 if self.port else 0)

    def check_ports_free(self) -> None:
        """The gateway's fixed ports, refused before the workers load (a taken --port failed
        only once both workers had started, ~15 s, as "gateway exited with code 1")."""
        check_ports_free("splitserve up", [
            ("--port", self.host, self.port), ("--admin-port", "127.0.0.1", self.admin_listen_port),
            ("--grpc-port", self.host, self.grpc_port)])

    def threads(self) -> dict[str, int]:
        """Torch threads per worker: the cores split between the workers (the gateway runs
        no torch), at least one each, so the processes do not oversubscribe the machine."""
        if self.num_threads:
            return {"prefill": self.num_threads, "decode": self.num_threads,
                    "both": self.num_threads}
        cores = host_cores()
        prefill = max(1, (cores or 2) // 2)
        return {"prefill": prefill, "decode": max(1, (cores or 2) - prefill),
                "both": max(1, cores or 1)}


class Child:
    """One child process and the reader thread that echoes its output."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.address = ""
        self.ready_line = ""
        self.ready = threading.Event()
        self.process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, text=True, bufsize=1, start_new_session=True, preexec_fn=_die_with_parent,
        )
        self._reader = threading.Thread(target=self._read, name=f"{name}-output", daemon=True)
        self._reader.start()
        print(f"[up] started {name} pid={self.process.pid}", flush=True)

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.startswith("SPLITSERVE_READY") and not self.ready.is_set():
                self.ready_line = line.strip()
                self.address = line.split()[2]
                self.ready.set()
            sys.stdout.write(f"[{self.name}] {line}")
            sys.stdout.flush()

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, deadline: float, interrupted: threading.Event) -> str:
        while not self.ready.wait(0.2):
            if interrupted.is_set():
                raise RuntimeError("interrupted")
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with code {self.process.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} was not ready in time")
        return self.address


def _die_with_parent() -> None:
    # Linux: the child gets SIGTERM if the launcher dies, even by SIGKILL: no orphans.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _child_env(threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def _wait_http_ready(url: str, deadline: float, gateway: Child) -> None:
    while time.monotonic() < deadline:
        if not gateway.alive():
            raise RuntimeError("the gateway exited")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer 200 in time")


class Deployment:
    def __init__(self, config: UpConfig) -> None:
        self.config = config
        self.children: list[Child] = []
        self.stop_requested = threading.Event()  # set by the signal handler
        self.grpc_address = ""
        self.admin_url = ""
        self._stopping = False
        self._folder = ""

    def start(self) -> str:
        cfg = self.config
        threads = cfg.threads()
        cli = [sys.executable, "-m", "splitserve_cli.main"]
        deadline = time.monotonic() + cfg.startup_timeout_s
        roles = ["prefill", "decode"] if cfg.mode == "disagg" else ["both"]
        share = (self._core_share()
                 if len(roles) > 1 and not cfg.num_threads and cfg.core_share else [])
        secret = self._cluster_secret()
        named = ["--served-model-name", cfg.served_model_name] if cfg.served_model_name else []
        workers = [self._spawn(role, cli + ["worker", "--role", role, "--model", cfg.model,
                                            "--host", cfg.host, "--port", "0",
                                            "--num-threads", str(threads[role])]
                               + share + secret + named, threads[role])
                   for role in roles]
        addresses = {w.name: w.wait_ready(deadline, self.stop_requested) for w in workers}
        if cfg.mode == "disagg":
            routing = ["--prefill", addresses["prefill"], "--decode", addresses["decode"]]
        else:
            routing = ["--worker", addresses["both"]]
        gateway = self._spawn("gateway", cli + ["gateway", "--model", cfg.model, "--host", cfg.host,
                                                "--port", str(cfg.port),
                                                "--grpc-port", str(cfg.grpc_port),
                                                "--admin-port", str(cfg.admin_port)]
                              + routing + secret + named, None)
        address = gateway.wait_ready(deadline, self.stop_requested)
        fields = dict(part.partition("=")[::2] for part in gateway.ready_line.split()[3:])
        self.grpc_address = fields.get("grpc", "")
        self.admin_url = f"http://{fields['admin']}"
        _wait_http_ready(f"{self.admin_url}/ready", deadline, gateway)
        return f"http://{address}"

    def _private_folder(self) -> str:
        """A folder only this user can read (mkdtemp makes it 0700), removed at exit."""
        if not self._folder:
            self._folder = tempfile.mkdtemp(prefix="splitserve-up-")
            atexit.register(shutil.rmtree, self._folder, ignore_errors=True)
        return self._folder

    def _core_share(self) -> list[str]:
        """The workers split the cores: each lends its share to the other while idle
        (services/common/core_share.py), through a file in the private folder."""
        return ["--core-share", os.path.join(self._private_folder(), "cores")]

    def _cluster_secret(self) -> list[str]:
        """A fresh random cluster secret for this deployment's processes, in a 0600 file:
        it authenticates the KV channels between the workers and keys the tenants'
        prefix-cache salts, so another local user who can reach the workers' ports can
        neither feed a decode worker KV blocks nor compute a tenant's salt to probe its
        cache. It is never printed and dies with the deployment."""
        path = os.path.join(self._private_folder(), "cluster-secret")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        return ["--cluster-secret-file", path]

    def _spawn(self, name: str, argv: list[str], threads: int | None) -> Child:
        child = Child(name, argv, _child_env(threads))
        self.children.append(child)
        return child

    def first_exited(self) -> Child | None:
        return next((c for c in self.children if not c.alive()), None)

    def stop(self) -> None:
        """Gateway first (no new work reaches the workers), then the workers."""
        if self._stopping:
            return
        self._stopping = True
        for group in (["gateway"], ["prefill", "decode", "both"]):
            members = [c for c in self.children if c.name in group and c.alive()]
            for child in members:
                child.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.config.stop_timeout_s
            for child in members:
                try:
                    child.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    print(f"[up] {child.name} did not stop in time; killing it", flush=True)
                    child.process.kill()
                    child.process.wait()
        print("[up] all processes stopped", flush=True)


def _env(name: str, default):
    return os.environ.get(f"SPLITSERVE_UP_{name.upper()}", default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=int(_env("port", 8000)), help="gateway port")
    parser.add_argument("--host", default=_env("host", "127.0.0.1"))
    parser.add_argument("--model", default=os.environ.get("SPLITSERVE_MODEL", DEFAULT_MODEL))
    parser.add_argument("--served-model-name", default=_env("served_model_name", ""),
                        help="the name clients send as \"model\" (default: the model "
                             "folder's name)")
    parser.add_argument("--mode", choices=MODES, default=_env("mode", "disagg"),
                        help="disagg: prefill + decode workers; agg: one worker doing both")
    parser.add_argument("--grpc-port", type=int, default=int(_env("grpc_port", -1)),
                        help="gateway gRPC front door port (-1: off)")
    parser.add_argument("--admin-port", type=int, default=int(_env("admin_port", 0)),
                        help="gateway admin port for /metrics and /ready, on 127.0.0.1 "
                             "(0: --port + 1, or any free port when --port is 0)")
    parser.add_argument("--num-threads", type=int, default=int(_env("num_threads", 0)),
                        help="torch threads per worker (0: split the cores)")
    parser.add_argument("--no-core-share", action="store_true",
                        default=_env("no_core_share", "") not in ("", "0"),
                        help="disagg with the cores split: each worker keeps to its half, "
                             "even while the other is idle (default: an idle worker lends its "
                             "half to the other)")
    parser.add_argument("--startup-timeout-s", type=float,
                        default=float(_env("startup_timeout_s", 600)))


def run(args: argparse.Namespace) -> int:
    try:
        config = UpConfig(port=args.port, host=args.host, model=args.model,
                          served_model_name=args.served_model_name, mode=args.mode,
                          grpc_port=args.grpc_port, admin_port=args.admin_port,
                          num_threads=args.num_threads, core_share=not args.no_core_share,
                          startup_timeout_s=args.startup_timeout_s)
    except ValueError as exc:
        raise SystemExit(f"splitserve up: {exc}") from None
    config.check_ports_free()
    print("[up] config " + " ".join(f"{k}={v}" for k, v in asdict(config).items()), flush=True)
    print(f"[up] torch threads per worker: {config.threads()}", flush=True)
    deployment = Deployment(config)
    stop_requested = deployment.stop_requested

    def on_signal(signum, frame) -> None:
        stop_requested.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        url = deployment.start()
    except RuntimeError as exc:
        print(f"[up] failed to start: {exc}", flush=True)
        deployment.stop()
        return 0 if stop_requested.is_set() else 1
    model = os.path.basename(os.path.normpath(config.model))
    print(f"\nsplitserve is up at {url}  (OpenAI base_url: {url}/v1)\n"
          f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
          f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", "
          f"\"content\": \"What is the capital of France?\"}}]}}'\n"
          + (f"  gRPC front door (splitserve.v1.Gateway): {deployment.grpc_address}\n"
             if deployment.grpc_address else "")
          + f"  admin (/metrics, /ready): {deployment.admin_url}\n"
          + "Ctrl-C stops everything.\n", flush=True)
    print(f"SPLITSERVE_UP {url}", flush=True)
    code = 0
    while not stop_requested.wait(0.5):
        exited = deployment.first_exited()
        if exited is not None:
            print(f"[up] {exited.name} exited with code {exited.process.returncode}; "
                  "stopping everything", flush=True)
            code = 1
            break
    deployment.stop()
    return code
