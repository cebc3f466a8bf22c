"""Two nodes of vLLM's engine on one machine (issue 43), as a vLLM user sets them up
without a second machine: TP=2 over two nodes, one worker per node, vLLM's multi-node
mp executor (``nnodes=2``).

- Node 0 is the driver's ``multinode`` command (an offline ``LLM``, ``node_rank=0``) or
  ``vllm serve`` with ``--nnodes 2 --node-rank 0``, bound to core 0.
- Node 1 is ``vllm serve --headless --nnodes 2 --node-rank 1``, bound to core 1, in a
  mount namespace of its own with a private ``/dev/shm`` (``unshare -m``, a fresh tmpfs)
  as a separate machine would have, or (``private_shm=False``) sharing this machine's,
  as two containers with one IPC namespace on one host do.
- The nodes talk over 127.0.0.1 / 127.0.0.2, or with ``link=True`` over a veth pair
  with node 1 in a network namespace of its own, so that the link can be cut.

The engine tests (``tests/engine/test_multinode.py``) and ``python -m shmq bench
--scenarios engine-multinode`` use it. Needs root (or the capabilities) for ``unshare``
and ``ip netns``; :func:`refused` says why not where they are refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from .engine import DRIVER, Rows, engine_env, in_turn, print_rows, progress_line

NODE0_IP, NODE1_IP = "127.0.0.1", "127.0.0.2"
# The veth pair of ``link=True``: node 0's end stays in this namespace, node 1's goes
# into NETNS.
NETNS, VETH0, VETH1 = "shmq-node1", "shmq-veth0", "shmq-veth1"
LINK0_IP, LINK1_IP = "10.231.0.1", "10.231.0.2"

ENGINE_FLAGS = [
    "-tp", "2", "--distributed-executor-backend", "mp", "--enforce-eager", "--max-model-len", "512",
    "--max-num-seqs", "64", "--dtype", "bfloat16", "--seed", "0",
]  # fmt: skip

# Node 1's wrapper, run in its namespaces: a private /dev/shm where asked, then the
# node's command as its child; when that ends, what is left in the node's /dev/shm after
# shmq's janitors (separate processes) had up to 5 s to remove what the dead made.
_NODE1_SCRIPT = r"""
if [ "$SHMQ_NODE1_PRIVATE_SHM" = 1 ]; then mount -t tmpfs -o size=1g tmpfs /dev/shm || exit 97; fi
"$@" &
child=$!
trap 'kill -KILL $child 2>/dev/null' TERM
wait $child
rc=$?
echo "NODE1-EXIT $rc $(date +%s.%N)"
for i in $(seq 50); do ls /dev/shm | grep -q '^shmq_' || break; sleep 0.1; done
echo "NODE1-SHM $(ls -A /dev/shm | grep -v '^sem\.' | tr '\n' ' ')"
"""


def _quiet(*argv: str) -> bool:
    return subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30).returncode == 0


def refused(link: bool = False) -> Optional[str]:
    """Why two nodes (with ``link``: and a network namespace) cannot be set up here;
    ``None`` where they can."""
    probe = ["unshare", "-m", "--propagation", "private", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"]
    try:
        if not _quiet(*probe):
            return "unshare -m with a fresh tmpfs on /dev/shm is refused here (needs root or CAP_SYS_ADMIN)"
        if link:
            name = f"shmq-probe-{os.getpid()}"
            if not _quiet("ip", "netns", "add", name):
                return "ip netns add is refused here (needs root or CAP_SYS_ADMIN)"
            _quiet("ip", "netns", "del", name)
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot run unshare / ip here: {e}"
    return None


@contextlib.contextmanager
def veth_link() -> Iterator[None]:
    """Node 1's network namespace and the veth pair to it (removed on exit)."""
    _quiet("ip", "netns", "del", NETNS)
    _quiet("ip", "link", "del", VETH0)
    steps = [
        ["ip", "netns", "add", NETNS],
        ["ip", "link", "add", VETH0, "type", "veth", "peer", "name", VETH1],
        ["ip", "link", "set", VETH1, "netns", NETNS],
        ["ip", "addr", "add", f"{LINK0_IP}/24", "dev", VETH0],
        ["ip", "link", "set", VETH0, "up"],
        ["ip", "-n", NETNS, "addr", "add", f"{LINK1_IP}/24", "dev", VETH1],
        ["ip", "-n", NETNS, "link", "set", VETH1, "up"],
        ["ip", "-n", NETNS, "link", "set", "lo", "up"],
    ]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True, timeout=30)
        yield
    finally:
        _quiet("ip", "link", "del", VETH0)
        _quiet("ip", "netns", "del", NETNS)


def limit_link(rate: str) -> None:
    """Shape node 0's end of the veth link to ``rate`` (``tc``'s token bucket, e.g.
    ``1gbit``), as a slower network would be."""
    subprocess.run(
        ["tc", "qdisc", "replace", "dev", VETH0, "root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"],
        check=True,
        timeout=30,
    )


def set_link(up: bool) -> None:
    """Cut (``up=False``) or restore the veth link, both ends, as a pulled cable does."""
    state = "up" if up else "down"
    subprocess.run(["ip", "link", "set", VETH0, state], check=True, timeout=30)
    subprocess.run(["ip", "-n", NETNS, "link", "set", VETH1, state], check=True, timeout=30)


def _children(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _title(pid: int) -> str:
    import psutil

    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return ""


class Node:
    """One node's process tree, its output in a log file."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        import threading

        self.log_path = log
        self._log = open(log, "w")
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        #: Every process of the node's tree seen while it ran (sampled), to tell what it
        #: made in a /dev/shm that other programs share (:func:`made_by`).
        self.pids_seen: set[int] = {self.proc.pid}
        threading.Thread(target=self._sample_pids, daemon=True).start()

    def _sample_pids(self) -> None:
        while self.proc.poll() is None:
            self.pids_seen.update(_children(self.proc.pid))
            time.sleep(0.2)

    def text(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def engine_pids(self) -> list[int]:
        """The node's vLLM processes: the ``vllm serve`` / driver process and every
        ``VLLM::`` process below it (shmq's janitors are detached: not among them)."""
        return [p for p in _children(self.proc.pid) if _title(p).startswith("VLLM::") or "driver.py" in _cmdline(p)]

    def pid_titled(self, prefix: str) -> Optional[int]:
        return next((p for p in _children(self.proc.pid) if _title(p).startswith(prefix)), None)

    def alive(self) -> bool:
        return bool(self.engine_pids())

    def wait_gone(self, timeout: float) -> Optional[float]:
        """Seconds until every vLLM process of the node is gone; ``None`` if some are
        still there after ``timeout``."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if not self.alive():
                return time.monotonic() - t0
            time.sleep(0.05)
        return None

    def signal(self, sig: int, pids: Optional[list[int]] = None) -> None:
        for p in self.engine_pids() if pids is None else pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)

    def stop(self) -> None:
        """Kill whatever is left of the node (its engine processes first, so that node
        1's wrapper still reports what they left) and wait for its wrapper."""
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(15)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)
        self._log.close()


def made_by(names: list[str], pids: set[int]) -> list[str]:
    """The shmq segment names of ``names`` that processes of ``pids`` made (a name
    carries its creator's pid: ``shmq_<kind>_<pid>_...``), and those that carry no pid."""
    mine = []
    for name in names:
        if not name.startswith("shmq_"):
            continue
        parts = name.split("_")
        if len(parts) < 4 or not parts[2].isdigit() or int(parts[2]) in pids:
            mine.append(name)
    return mine


def _cmdline(pid: int) -> str:
    import psutil

    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


class Node1(Node):
    """``vllm serve --headless`` as node 1."""

    def __init__(
        self,
        python: str,
        model: str,
        plugin: bool,
        port: int,
        log: Path,
        private_shm: bool = True,
        link: bool = False,
        **extra: str,
    ) -> None:
        ip = LINK1_IP if link else NODE1_IP
        master = LINK0_IP if link else NODE0_IP
        env = engine_env(plugin, VLLM_HOST_IP=ip, VLLM_CPU_OMP_THREADS_BIND="1", PYTHONUNBUFFERED="1", **extra)
        env["SHMQ_NODE1_PRIVATE_SHM"] = "1" if private_shm else "0"
        if link:
            env["GLOO_SOCKET_IFNAME"] = VETH1
        serve = [python, str(DRIVER), "serve", model, "--headless", "--nnodes", "2", "--node-rank", "1"]
        serve += ["--master-addr", master, "--master-port", str(port), *ENGINE_FLAGS]
        wrap = ["unshare", "-m", "--propagation", "private", "bash", "-c", _NODE1_SCRIPT, "node1", *serve]
        if link:
            wrap = ["ip", "netns", "exec", NETNS, *wrap]
        super().__init__(wrap, env, log)

    def leftovers(self, timeout: float = 30) -> Optional[list[str]]:
        """What was left in node 1's ``/dev/shm`` once its command ended (``None``: not
        ended within ``timeout``)."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        for line in self.text().splitlines():
            if line.startswith("NODE1-SHM"):
                return line.split()[1:]
        return None

    def exited_at(self) -> Optional[float]:
        """The wall-clock time node 1's command ended (from its wrapper)."""
        for line in self.text().splitlines():
            if line.startswith("NODE1-EXIT"):
                return float(line.split()[2])
        return None


def node0_env(plugin: bool, link: bool = False) -> dict[str, str]:
    env = engine_env(
        plugin,
        VLLM_HOST_IP=LINK0_IP if link else NODE0_IP,
        VLLM_CPU_OMP_THREADS_BIND="0",
        PYTHONUNBUFFERED="1",
        VLLM_LOGGING_LEVEL="INFO",
    )
    if link:
        env["GLOO_SOCKET_IFNAME"] = VETH0
    return env


class Node0(Node):
    """The driver's ``multinode`` command (an offline ``LLM``) as node 0."""

    def __init__(
        self, python: str, model: str, plugin: bool, port: int, log: Path, *args: str, link: bool = False, **extra: str
    ):
        argv = [python, str(DRIVER), "multinode", model, "--master-port", str(port), *args]
        super().__init__(argv, {**node0_env(plugin, link), **extra}, log)

    def wait_line(self, prefix: str, timeout: float) -> Optional[str]:
        """The first line of node 0's output that starts with ``prefix``, once there;
        ``None`` after ``timeout`` seconds, or once node 0 has exited without it."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.text().splitlines():
                if line.startswith(prefix):
                    return line
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return None
            time.sleep(0.1)

    def result(self, timeout: float) -> dict[str, Any]:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        line = self.wait_line("RESULT ", 0)
        if line is None:
            raise RuntimeError(f"node 0 gave no result:\n{self.text()[-6000:]}")
        return dict(json.loads(line[len("RESULT ") :]))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Node0Serve(Node):
    """``vllm serve --nnodes 2 --node-rank 0`` as node 0, its API on 127.0.0.1."""

    def __init__(self, python: str, model: str, plugin: bool, port: int, log: Path, start_timeout: float = 240):
        self.model = model
        self.http_port = free_port()
        argv = [python, str(DRIVER), "serve", model, "--nnodes", "2", "--node-rank", "0"]
        argv += ["--master-addr", NODE0_IP, "--master-port", str(port), *ENGINE_FLAGS]
        argv += ["--host", "127.0.0.1", "--port", str(self.http_port)]
        super().__init__(argv, node0_env(plugin), log)
        deadline = time.monotonic() + start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("node 0's vllm serve exited:\n" + self.text()[-6000:])
            try:
                self.http("/health", timeout=2)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("node 0's vllm serve did not start:\n" + self.text()[-6000:]) from None
                time.sleep(0.5)

    def http(self, path: str, body: Optional[dict[str, Any]] = None, timeout: float = 60.0) -> str:
        import urllib.request

        data = None if body is None else json.dumps(body).encode()
        url = f"http://127.0.0.1:{self.http_port}{path}"
        request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return str(response.read().decode())

    def complete(self, prompt: str, max_tokens: int = 16, timeout: float = 60.0) -> str:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        return str(json.loads(self.http("/v1/completions", body, timeout))["choices"][0]["text"])


FAULTS = ("worker", "whole", "stop", "core", "cut2", "cut30")


def _inject(fault: str, node0: Node0, node1: Node, end_at_error: bool = False) -> None:
    """One fault of issue 43: node 1's worker SIGKILLed (``worker``), node 1 whole
    (``whole``), node 1 stopped for 10 s (``stop``), node 0's engine core SIGKILLed
    (``core``), the link cut for 2 s or 30 s (``cut2``, ``cut30``). ``end_at_error``: a
    timed fault (the stop, a cut) ends early once node 0's caller has had its error (or
    node 0 has ended), when what a test asks of it (the error within the bound, not at
    the fault's end) is known."""
    if fault == "worker":
        worker = node1.pid_titled("VLLM::Worker")
        assert worker is not None, "node 1 has no worker"
        node1.signal(signal.SIGKILL, [worker])
    elif fault == "whole":
        node1.signal(signal.SIGKILL)
    elif fault == "stop":
        node1.signal(signal.SIGSTOP)
        _last(10, node0, end_at_error)
        node1.signal(signal.SIGCONT)
    elif fault == "core":
        core = node0.pid_titled("VLLM::EngineCore")
        assert core is not None, "node 0 has no engine core"
        node0.signal(signal.SIGKILL, [core])
    elif fault.startswith("cut"):
        set_link(False)
        _last(float(fault[3:]), node0, end_at_error)
        set_link(True)
    else:
        raise ValueError(f"unknown fault {fault!r}: one of {FAULTS}")


def _last(seconds: float, node0: Node0, end_at_error: bool) -> None:
    """A timed fault's length: ``seconds``, or less with ``end_at_error`` (``_inject``)."""
    if end_at_error:
        node0.wait_line("ERROR ", seconds)
    else:
        time.sleep(seconds)


def run_offline(
    python: str,
    model: str,
    plugin: bool,
    log_dir: Path,
    faults: tuple[str, ...] = (),
    private_shm: bool = True,
    reps: int = 1,
    window: float = 50.0,
    between: float = 6.0,
    link: Optional[str] = None,
    node1_wait: float = 15.0,
    ending: str = "scope",
    end_faults_at_error: bool = False,
    **extra: str,
) -> dict[str, Any]:
    """Node 1, then node 0 offline; greedy tokens, then (``faults``) generation for
    ``window`` seconds with the faults injected one after the other, the first 2 s in,
    each next one ``between`` seconds after the last ended. Returns node 0's result
    with:

    - ``node1_left``: node 1's ``/dev/shm`` once it ended (``None``: still running
      ``node1_wait`` seconds after node 0's end; then it is killed, and what it left
      then is ``node1_left_after_kill``);
    - ``node1_gone_after_s``: node 1's end after node 0's (its last engine process
      gone), or after the last fault where node 0 never ended;
    - ``error_after_s``: the caller's error after the last fault;
    - ``batches_after``: per fault, the batches that completed after it (before the
      next one).

    ``end_faults_at_error``: a timed fault ends once node 0's caller has had its error
    (``_inject``; the bench's faults last their whole length, beside vLLM alone's).
    ``ending``: how node 0's ``LLM`` ends (``scope``: it goes out of scope;
    ``shutdown``: its engine is shut down explicitly first). ``link``: ``"veth"`` puts
    node 1 behind the veth pair (also where a fault cuts it), a rate (``"1gbit"``)
    shapes that link too; ``extra``: environment for both nodes."""
    rate = link if link not in (None, "veth") else None
    link_on = bool(link) or any(f.startswith("cut") for f in faults)
    port = free_port()
    tag = f"{'on' if plugin else 'off'}-{'-'.join(faults) or 'none'}{'' if private_shm else '-shared'}"
    tag += f"-{link}" if link else ""
    with veth_link() if link_on else contextlib.nullcontext():
        if rate:
            limit_link(rate)
        node1 = Node1(
            python, model, plugin, port, log_dir / f"node1-{tag}.log", private_shm=private_shm, link=link_on, **extra
        )
        args = ["--reps", str(reps), "--end", ending]
        if faults:
            args += ["--fault-window", str(window), "--limit", "30"]
        node0 = Node0(python, model, plugin, port, log_dir / f"node0-{tag}.log", *args, link=link_on, **extra)
        fault_at: list[float] = []
        try:
            if faults:
                if node0.wait_line("GENERATING", 300) is None:
                    raise RuntimeError(f"node 0 did not start generating:\n{node0.text()[-6000:]}")
                time.sleep(2)
                for i, fault in enumerate(faults):
                    if i:
                        time.sleep(between)
                    fault_at.append(time.time())
                    _inject(fault, node0, node1, end_faults_at_error)
            out = node0.result(window + 200)
            left = node1.leftovers(node1_wait)
            if left is None:  # still running: what it leaves once killed
                node1.stop()
                out["node1_left_after_kill"] = node1.leftovers(0)
            end = out.get("engine_gone_at") if not out.get("hung") else (fault_at[-1] if fault_at else None)
            exited = node1.exited_at()
            out["node1_left"] = left
            out["node1_gone_after_s"] = None if exited is None or end is None else exited - end
            error_at = out.get("error_at")
            out["error_after_s"] = error_at - fault_at[-1] if error_at and fault_at else None
            bounds = [*fault_at[1:], float("inf")] if fault_at else []
            text = node0.text()
            out["lost_warned"] = "is gone" in text
            out["node_watch_fired"] = "gone for the step broadcast" in text
            batches = out.get("batches_at", [])
            spans = zip(fault_at, bounds, strict=True)
            out["batches_after"] = [len([b for b in batches if t < b < u]) for t, u in spans]
            out["node0_log"], out["node1_log"] = node0.text()[-6000:], node1.text()[-6000:]
            out["pids_seen"] = node0.pids_seen | node1.pids_seen
            return out
        finally:
            node0.stop()
            node1.stop()


def _profile(out_dir: Path) -> dict[str, dict[str, float]]:
    """The engine processes' queue-call totals (the driver's SHMQ_ENGINE_PROFILE), summed
    by process title: ``{title: {"<cls>.<call>": per-call wall µs, ... "_cpu": per-call
    CPU µs}}``."""
    totals: dict[str, dict[str, list[float]]] = {}
    for f in out_dir.glob("*.json"):
        data = json.loads(f.read_text())
        for key, (n, cpu, wall) in data["stats"].items():
            t = totals.setdefault(data["title"], {}).setdefault(key, [0, 0.0, 0.0])
            t[0] += n
            t[1] += cpu
            t[2] += wall
    return {
        title: {
            **{k: v[2] / v[0] * 1e6 for k, v in keys.items() if v[0]},
            **{k + "_cpu": v[1] / v[0] * 1e6 for k, v in keys.items() if v[0]},
        }
        for title, keys in totals.items()
    }


def run_bench(rounds: int, progress: Any = None) -> tuple[Rows, list[tuple[str, str, str]]]:
    """``--scenarios engine-multinode``: two nodes, plugin off and on alternately.
    Returns (rows: label, off, on, unit; fault rows: fault, off, on as text)."""
    import statistics
    import tempfile

    from .engine import _engine

    python, model = _engine("engine-model")
    got: dict[bool, dict[str, list[float]]] = {False: {}, True: {}}
    logs = Path(tempfile.mkdtemp(prefix="shmq-multinode-"))
    for r in range(rounds):
        for link in (None, "veth", "1gbit"):
            for plugin in in_turn(r):
                if progress:
                    progress(f"round {r + 1}/{rounds}, link {link or 'loopback'}, plugin {'on' if plugin else 'off'}")
                prof = Path(tempfile.mkdtemp(prefix="shmq-multinode-profile-"))
                out = run_offline(python, model, plugin, logs, reps=3, link=link, SHMQ_ENGINE_PROFILE=str(prof))
                key = link or "loopback"
                tpot = statistics.median(out["time_per_output_token_s"]) * 1e3
                got[plugin].setdefault(f"tpot_{key}", []).append(tpot)
                cls = "shmq" if plugin else "vllm"
                for title, calls in _profile(prof).items():
                    if title.startswith("VLLM::EngineCore") and f"{cls}.enqueue" in calls:
                        got[plugin].setdefault(f"enqueue_{key}", []).append(calls[f"{cls}.enqueue"])
                    if title.startswith("VLLM::Worker") and f"{cls}.dequeue_cpu" in calls:
                        got[plugin].setdefault(f"dequeue_cpu_{key}", []).append(calls[f"{cls}.dequeue_cpu"])
    rows = []
    for key in ("loopback", "veth", "1gbit"):
        for what, label, unit in (
            ("tpot", "time per output token, one request alone", "ms"),
            ("enqueue", "the executor's step broadcast: enqueue, wall per call", "µs"),
            ("dequeue_cpu", "a worker's dequeue: CPU per call (both nodes' workers)", "µs"),
        ):
            k = f"{what}_{key}"
            if got[False].get(k) and got[True].get(k):
                rows.append(
                    (f"{label} ({key})", statistics.median(got[False][k]), statistics.median(got[True][k]), unit)
                )
    faults: list[tuple[str, str, str]] = []
    for plan in (("worker",), ("whole",), ("stop",), ("cut2", "cut30"), ("core",)):
        cells = []
        for plugin in (False, True):
            if progress:
                progress(f"faults {'+'.join(plan)}, plugin {'on' if plugin else 'off'}")
            out = run_offline(python, model, plugin, logs, faults=plan)
            cells.append(_describe(plan, out))
        faults.append(("then ".join(_FAULT_LABELS[f] + " " for f in plan).strip(), cells[0], cells[1]))
    return rows, faults


_FAULT_LABELS = {
    "worker": "node 1's worker SIGKILLed",
    "whole": "node 1 SIGKILLed whole",
    "stop": "node 1 stopped (SIGSTOP) for 10 s",
    "core": "node 0's engine core SIGKILLed",
    "cut2": "the link cut for 2 s,",
    "cut30": "the link cut for 30 s",
}


def _describe(plan: tuple[str, ...], out: dict[str, Any]) -> str:
    parts = []
    if len(plan) > 1:
        parts.append(f"{out['batches_after'][0]} batches completed after the first cut")
    if out.get("hung"):
        parts.append("the caller hung (no error within 30 s after the window)")
    elif out.get("error"):
        parts.append(f"error after {out['error_after_s']:.1f} s")
    else:
        parts.append(f"no error ({out['batches_after'][-1]} batches completed after)")
    if out.get("node1_left") is None:
        parts.append("node 1 still running 15 s after node 0's end")
    else:
        gone = out.get("node1_gone_after_s")
        parts.append(f"node 1 ended {gone:.1f} s after node 0" if gone is not None else "node 1 ended")
    left = [n for n in (out.get("node1_left") or out.get("node1_left_after_kill") or []) if n.startswith("shmq_")]
    parts.append(f"{len(out.get('shm_after') or []) + len(left)} shmq files left")
    return "; ".join(parts)


def main(rounds: int) -> int:
    import sys

    refusal = refused(link=True)
    if refusal:
        print(f"engine-multinode: not run: {refusal}", file=sys.stderr)
        return 1
    rows, faults = run_bench(rounds, progress_line("engine-multinode"))
    title = f"vLLM's engine on two nodes (vllm-cpu 0.32.0, TP=2, one worker per node), medians of {rounds} round(s)"
    print_rows(title, "plugin off (vLLM's queues)", "plugin on (shmq)", "on / off", rows)
    print("\nFaults on two nodes (one run each)")
    print("| fault | vLLM alone | with shmq |")
    print("|---|---|---|")
    for label, off_cell, on_cell in faults:
        print(f"| {label} | {off_cell} | {on_cell} |")
    return 0
