"""Runs of train.py (and the scripts) forked from one process that has already imported torch, diffusers,
transformers and sd_training, instead of a fresh ``python`` each time: a fresh interpreter spends ~12
CPU-seconds importing them (measured on the 2-core machine), more than a tiny run's own steps, and a
torchrun launch of 2 ranks ~27.

    res = forked.run([sys.executable, "train.py", *args], capture_output=True, text=True, timeout=600)
    p = forked.popen([sys.executable, "train.py", *args], cwd=..., env=..., stdout=PIPE, stderr=STDOUT)
    p = forked.popen([sys.executable, "train.py", *args], nproc=2, ...)   # 2 ranks, as torchrun starts them
    forked.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", ..., "train.py", ...])  # the same

Each run is a child of a "zygote": one process per pytest process, started on first use, that imported the
runs' modules and runs nothing else (no thread, no tensor op). The child takes its argv (a script, ``-m
module`` or ``-c code``), working folder, environment, standard streams and session, and runs it as
``__main__`` (``runpy``), so it exits as that interpreter would (its exit code, a traceback and 1 on an
exception, atexit handlers, non-daemon threads). The object returned behaves as ``subprocess.Popen``: pid,
poll, wait, communicate, send_signal, kill, stdout/stderr pipes; ``os.killpg(p.pid, ...)`` works with
``start_new_session=True``.

``nproc=N`` (or a torchrun command line with only --nproc_per_node, --master_addr=127.0.0.1, --master_port
and --nnodes=1) forks a small launcher (the returned pid: SIGTERM/SIGINT to it reach the ranks, ``kill_tree``
kills them all) that forks N ranks with torchrun's rank variables (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR=127.0.0.1, MASTER_PORT; env:// rendezvous, rank 0 hosts the store);
when one rank fails it stops the others (SIGTERM, SIGKILL after 30 s) and exits with that rank's code (1 when
it died by a signal), else 0.

What stays a real ``subprocess``: a test of what happens while a fresh interpreter imports (a signal during
set-up), of torchrun itself (restarts, its agent's store), of a module loading without sd_training imported
beside it, and any run whose environment differs from the zygote's in what libraries read when they are
imported (IMPORT_TIME_ENV: HF_*, TRANSFORMERS_*, DIFFUSERS_*, TORCH*, PYTORCH_*, MKL_*, PYTHON*, LD_*, CUDA_*;
not PYTHONPATH, applied in the child, nor TORCHINDUCTOR_CACHE_DIR as torch sets it): ``popen``/``run`` start
such runs as real subprocesses themselves. ``FORKED_RUNS=0`` starts every run as a real subprocess (to
compare); ``FORKED_LOG=path`` appends a line per zygote start, per run (its CPU time) and per run started as
a real subprocess (why).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

PIPE, STDOUT, DEVNULL = subprocess.PIPE, subprocess.STDOUT, subprocess.DEVNULL
ROOT = Path(__file__).resolve().parents[1]
BASE_ENV = dict(os.environ)  # the zygote's environment: this process's when the tests were collected
# Read by libraries when they are imported (or by the interpreter at start-up): a run whose environment
# differs from the zygote's in one of these is started as a real subprocess. OMP_NUM_THREADS is applied
# with torch.set_num_threads in the child.
IMPORT_TIME_ENV = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DIFFUSERS_", "TORCH", "PYTORCH_", "MKL_", "PYTHON", "LD_",
                   "CUDA_", "KMP_", "GOMP_", "BITSANDBYTES_")
SET_BY_TORCH = ("TORCHINDUCTOR_CACHE_DIR",)


# ----------------------------------------------------------------------------------------------- client
class Forked:
    """A forked run, as ``subprocess.Popen`` (the parts the tests use)."""

    def __init__(self, zygote: _Zygote, pid: int, args, stdout, stderr):
        self._zygote, self.pid, self.args, self.returncode = zygote, pid, args, None
        self.stdout, self.stderr, self.stdin = stdout, stderr, None

    def poll(self):
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, 0)
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            code = self._zygote.exit_code(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = code
        return self.returncode

    def communicate(self, input=None, timeout=None):  # noqa: A002 (Popen's name)
        assert input is None, "forked runs take no stdin"
        deadline = None if timeout is None else time.monotonic() + timeout
        streams = [s for s in (self.stdout, self.stderr) if s is not None and not s.closed]
        chunks = {id(s): [] for s in streams}
        while streams:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select(streams, [], [], left)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout)
            for s in ready:
                data = os.read(s.fileno(), 1 << 16)
                if data:
                    chunks[id(s)].append(data)
                else:
                    streams.remove(s)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        out = []
        for s in (self.stdout, self.stderr):
            if s is None or s.closed:
                out.append(None)
                continue
            data = b"".join(chunks.get(id(s), []))
            out.append(data.decode(errors="replace") if isinstance(s, _TextReader) else data)
            s.close()
        return tuple(out)

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for s in (self.stdout, self.stderr):
            if s is not None:
                s.close()
        self.wait()


class _TextReader:
    """A pipe's read end as text lines (``for line in p.stdout``, ``p.stdout.read()``)."""

    def __init__(self, fd: int):
        self._f = os.fdopen(fd, "r", errors="replace")

    def fileno(self):
        return self._f.fileno()

    def read(self, *a):
        return self._f.read(*a)

    def readline(self):
        return self._f.readline()

    def __iter__(self):
        return iter(self._f.readline, "")

    @property
    def closed(self):
        return self._f.closed

    def close(self):
        self._f.close()


class _Zygote:
    def __init__(self, env: dict):
        self.env = dict(env)
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()],
                                     env=self.env, cwd=ROOT, start_new_session=True, stdout=DEVNULL, stderr=DEVNULL)
        theirs.close()
        self.exits: dict[int, int] = {}
        self.lock = threading.Lock()
        reply = self._next(lambda m: "ready" in m, 600)
        assert reply is not None, "the zygote did not start"

    def _pump(self, timeout) -> list[dict]:
        """Messages from the zygote (exits are recorded); waits up to ``timeout`` for the first one."""
        got = []
        ready, _, _ = select.select([self.sock], [], [], timeout)
        while ready:
            data = self.sock.recv(1 << 16)
            if not data:
                raise RuntimeError(f"the zygote died (exit code {self.proc.poll()})")
            msg = json.loads(data)
            if "exit" in msg:
                self.exits[msg["exit"]] = msg["code"]
            got.append(msg)
            ready, _, _ = select.select([self.sock], [], [], 0)
        return got

    def _next(self, want, timeout):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            for msg in self._pump(left):
                if want(msg):
                    return msg
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def spawn(self, request: dict, fds: list[int]) -> int:
        with self.lock:
            socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
            return self._next(lambda m: "pid" in m, 60)["pid"]

    def exit_code(self, pid: int, timeout):
        with self.lock:
            if pid not in self.exits:
                self._next(lambda m: m.get("exit") == pid, timeout)
            return self.exits.get(pid)

    def close(self):
        self.sock.close()  # the zygote kills what is left of its runs and exits
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_ZYGOTE: _Zygote | None = None


def _zygote() -> _Zygote:
    global _ZYGOTE
    if _ZYGOTE is None or _ZYGOTE.proc.poll() is not None:
        _ZYGOTE = _Zygote(BASE_ENV)
        atexit.register(_ZYGOTE.close)
    return _ZYGOTE


def _differs_at_import(env: dict, zygote_env: dict) -> list[str]:
    keys = {k for k in set(env) | set(zygote_env) if k.startswith(IMPORT_TIME_ENV)}
    # torch sets TORCHINDUCTOR_CACHE_DIR to its default in the process that asks for it (read when compiling)
    same = {k for k in SET_BY_TORCH if env.get(k) == os.environ.get(k)} | {"PYTHONPATH"}  # applied in the child
    return sorted(k for k in keys - same if env.get(k) != zygote_env.get(k))


TORCHRUN_OPTS = {"--nproc_per_node": "nproc", "--nproc-per-node": "nproc", "--master_port": "port",
                 "--master-port": "port",
                 "--master_addr": "addr", "--master-addr": "addr", "--nnodes": "nnodes"}


def _entry(args) -> tuple[list[str], int, int | None] | None:
    """``([script, *argv] or ["-m", module, *argv], nproc, master_port)`` of a ``python`` command line (or of
    ``python -m torch.distributed.run`` with only --nproc_per_node, --master_addr=127.0.0.1, --master_port and
    --nnodes=1), or None (not forkable: started as a real subprocess)."""
    args = [str(a) for a in args]
    if len(args) < 2 or args[0] != sys.executable:
        return None
    rest, nproc, port = args[1:], 1, None
    if rest[:2] == ["-m", "torch.distributed.run"]:
        rest = rest[2:]
        while rest and rest[0].startswith("--"):
            key, _, value = rest.pop(0).partition("=")
            what = TORCHRUN_OPTS.get(key)
            if what is None or not value:
                return None
            if what == "nproc":
                nproc = int(value)
            elif what == "port":
                port = int(value)
            elif (what, value) not in (("addr", "127.0.0.1"), ("addr", "localhost"), ("nnodes", "1")):
                return None
    if not rest or rest[0].startswith("-") and (rest[0] not in ("-m", "-c") or len(rest) < 2):
        return None
    return rest, nproc, port


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def popen(args, *, cwd=None, env=None, stdin=None, stdout=None, stderr=None, text=False, start_new_session=False,
          nproc: int = 1, master_port: int | None = None, **popen_kw):
    """``subprocess.Popen(args, ...)`` for ``args = [sys.executable, script_or_-m, ...]``, forked from the
    zygote (``nproc`` ranks under a launcher when > 1). Falls back to a real subprocess where a fork would not
    be the same run (see the module's docstring)."""
    env = dict(os.environ if env is None else env)
    parsed = _entry(args)
    if parsed is not None and parsed[1] > 1:  # a torchrun command line
        entry, nproc, master_port = parsed
    elif parsed is not None:
        entry = parsed[0]
    differs = _differs_at_import(env, BASE_ENV)
    if parsed is None or popen_kw or stdin == PIPE or differs or os.environ.get("FORKED_RUNS") == "0":
        _log(f"a real subprocess for {[str(a) for a in args[:3]]}: environment {differs}, keywords {sorted(popen_kw)}")
        if nproc > 1 and parsed is not None and parsed[1] == 1:  # ranks asked for here: torchrun starts them
            args = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                    "--master_addr=127.0.0.1", f"--master_port={master_port or _free_port()}", *entry]
        elif nproc > 1 and parsed is None:
            raise ValueError(f"nproc={nproc} needs a python command line: {args[:3]}")
        return subprocess.Popen(args, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr, text=text,
                                start_new_session=start_new_session, **popen_kw)
    zygote = _zygote()
    theirs = []  # the child's ends: closed here once the zygote holds them

    def pipe_for(target):
        if target is None:
            return None, None
        if target == PIPE:
            r, w = os.pipe()
            theirs.append(w)
            return (_TextReader(r) if text else os.fdopen(r, "rb")), w
        if target == DEVNULL:
            w = os.open(os.devnull, os.O_WRONLY)
            theirs.append(w)
            return None, w
        fd = target if isinstance(target, int) else target.fileno()
        return None, fd

    out_obj, out_fd = pipe_for(stdout)
    if stderr == STDOUT:
        err_obj, err_fd = None, (out_fd if out_fd is not None else 1)
    else:
        err_obj, err_fd = pipe_for(stderr)
    if stdin is None or stdin == DEVNULL:
        in_fd = os.open(os.devnull, os.O_RDONLY)
        theirs.append(in_fd)
    else:
        in_fd = stdin if isinstance(stdin, int) else stdin.fileno()
    fds = [out_fd if out_fd is not None else 1, err_fd if err_fd is not None else 2, in_fd]
    if nproc > 1 and master_port is None:
        master_port = _free_port()
    request = {"entry": entry, "cwd": str(cwd or os.getcwd()), "env": env, "base_env": BASE_ENV,
               "session": bool(start_new_session),
               "nproc": nproc, "master_port": master_port}
    try:
        pid = zygote.spawn(request, fds)
    finally:
        for fd in theirs:
            os.close(fd)
    return Forked(zygote, pid, args, out_obj, err_obj)


def run(args, *, timeout=None, capture_output=False, check=False, text=False, cwd=None, env=None, stdout=None,
        stderr=None, nproc: int = 1, **kw):
    """``subprocess.run`` for a forked run (see ``popen``)."""
    if capture_output:
        stdout = stderr = PIPE
    p = popen(args, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=text, nproc=nproc, **kw)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(p.pid)
        p.wait()
        raise
    res = subprocess.CompletedProcess(args, p.returncode, out, err)
    if check:
        res.check_returncode()
    return res


def _kill_tree(pid: int) -> None:
    from conftest import kill_tree

    kill_tree(pid)


# ----------------------------------------------------------------------------------------------- zygote
PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.nn.parallel",
    "torch.utils.data", "safetensors.torch", "numpy", "PIL.Image", "omegaconf", "webdataset", "yaml",
    "transformers", "diffusers", "diffusers.guiders", "peft", "PIL.JpegImagePlugin", "PIL.PngImagePlugin",
]
LAZY = {  # names whose first access imports their modules (diffusers' and transformers' lazy modules)
    "diffusers": ["StableDiffusionPipeline", "StableDiffusionXLPipeline", "StableDiffusion3Pipeline", "FluxPipeline",
                  "AutoencoderKL", "UNet2DConditionModel", "SD3Transformer2DModel", "FluxTransformer2DModel",
                  "DDPMScheduler", "EulerDiscreteScheduler", "FlowMatchEulerDiscreteScheduler", "DDIMScheduler"],
    "transformers": ["CLIPTextModel", "CLIPTextModelWithProjection", "CLIPTokenizer", "T5EncoderModel",
                     "T5TokenizerFast", "CLIPTokenizerFast"],
}


def _preload() -> None:
    import importlib
    import pkgutil

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 -- a run that needs it fails the same way
            pass
    for mod, names in LAZY.items():
        m = sys.modules.get(mod)
        for n in names:
            try:
                getattr(m, n)
            except Exception:  # noqa: BLE001
                pass
    import sd_training

    for info in pkgutil.walk_packages(sd_training.__path__, "sd_training."):
        if info.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 -- a half-edited module: the run imports it itself (and fails as it would)
            pass


def _run_entry(entry: list[str]) -> None:
    """Runs ``python <entry>`` in this process, as ``__main__``; exits as that interpreter would."""
    import runpy

    # sys.path as that interpreter's: the script's folder (the working folder for -m and -c), then PYTHONPATH.
    first = os.path.dirname(os.path.abspath(entry[0])) if entry[0] not in ("-m", "-c") else os.getcwd()
    extra = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:1] = [first, *extra]
    if entry[0] == "-m":
        sys.argv = [entry[1], *entry[2:]]
        runpy.run_module(entry[1], run_name="__main__", alter_sys=True)
    elif entry[0] == "-c":
        sys.argv = ["-c", *entry[2:]]
        main = type(sys)("__main__")
        sys.modules["__main__"] = main
        exec(compile(entry[1], "<string>", "exec"), main.__dict__)
    else:
        sys.argv = [entry[0], *entry[1:]]
        runpy.run_path(entry[0], run_name="__main__")
    raise SystemExit(0)


def _become(request: dict, fds: list[int]) -> None:
    """In a forked child: the run's streams, folder, environment and session."""
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    os.dup2(fds[2], 0)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    sys.stdout.reconfigure(line_buffering=os.isatty(1))  # as the interpreter sets it up: line-buffered on a tty
    if request["session"]:
        os.setsid()
    os.chdir(request["cwd"])
    # The run's environment: what differs from the zygote's start is applied to its environment now (which
    # keeps what its imports set, as a fresh interpreter's imports would).
    env, base = request["env"], request["base_env"]
    for k in set(base) - set(env):
        os.environ.pop(k, None)
    os.environ.update({k: v for k, v in env.items() if base.get(k) != v})
    threads = request["env"].get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        import torch

        if torch.get_num_threads() != int(threads):
            torch.set_num_threads(int(threads))


def _launcher(request: dict) -> None:
    """A forked child that forks ``nproc`` ranks and waits for them, as torchrun's agent does."""
    n, ranks = request["nproc"], {}
    for rank in range(n):
        pid = os.fork()
        if pid == 0:
            os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n),
                               "LOCAL_WORLD_SIZE": str(n), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": str(request["master_port"])})
            _run_entry(request["entry"])
        ranks[pid] = rank

    def forward(sig, _frame):
        for pid in ranks:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    failed, kill_at = None, None
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if kill_at is not None and time.monotonic() > kill_at:
                forward(signal.SIGKILL, None)
                kill_at = None
            time.sleep(0.05)
            continue
        if pid not in ranks:
            continue
        del ranks[pid]
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and failed is None:
            failed = code if code > 0 else 1
            sys.stderr.write(f"forked launcher: rank exited with {code}; stopping the others\n")
            forward(signal.SIGTERM, None)
            kill_at = time.monotonic() + 30
    sys.stderr.flush()
    os._exit(failed or 0)


def _log(line: str) -> None:
    """FORKED_LOG=path: a line per zygote start and per run's exit, with their CPU time."""
    if os.environ.get("FORKED_LOG"):
        with open(os.environ["FORKED_LOG"], "a") as fh:
            fh.write(f"{time.strftime('%H:%M:%S')} {line}\n")


def _serve(fd: int) -> None:
    sys.path[0] = str(ROOT)  # the repository's sd_training first, as for ``python train.py``
    _preload()
    if threading.active_count() != 1:
        raise RuntimeError(f"a preloaded module started threads: {threading.enumerate()}")
    _log(f"zygote {os.getpid()} ready after {time.process_time():.1f} CPU-s")
    sock = socket.socket(fileno=fd)
    sock.send(json.dumps({"ready": os.getpid()}).encode())
    live: set[int] = set()
    while True:
        ready, _, _ = select.select([sock], [], [], 0.05)
        if ready:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 8)
            if not msg:
                break
            request = json.loads(msg)
            pid = os.fork()
            if pid == 0:
                sock.close()
                _become(request, fds)
                if request["nproc"] > 1:
                    _launcher(request)
                _run_entry(request["entry"])
            for f in set(fds):
                os.close(f)
            live.add(pid)
            sock.send(json.dumps({"pid": pid}).encode())
        while live:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            live.discard(pid)
            code, cpu = os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime
            sock.send(json.dumps({"exit": pid, "code": code, "cpu": cpu}).encode())
            _log(f"run {pid} exited {code} after {cpu:.1f} CPU-s")
    for pid in live:  # the client went away: its runs go too
        try:
            os.killpg(pid, signal.SIGKILL) if os.getpgid(pid) == pid else os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in live:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    _serve(int(sys.argv[2]))
