"""``python -m shmq bench`` where torch is not installed (the README's first command
installs only ``shmq[bench]``: the bench's distribution, shmq-bench, with numpy, pyzmq and
iceoryx2): the bench runs every row it
can, prints its table, says what each skipped row needs, and exits 0 (a skip is not a
failure).

torch is hidden from the bench and from every process it spawns by a ``sitecustomize``
on ``PYTHONPATH`` whose meta-path finder refuses ``torch`` and ``torch.*``.

The bench is a distribution of its own (``bench/``, package ``shmq_bench``): where it is
not installed, ``python -m shmq bench`` says in one line how to install it; its version is
shmq's, and shmq's ``[bench]`` extra names exactly that one.

The iceoryx2 column's transport moves what it is given to several readers intact, in
real processes started by the bench's harness, and says what it needs where iceoryx2
is not installed.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]

HIDE_TORCH = textwrap.dedent(
    """
    import sys


    class _NoTorch:
        # Found before every other finder: `import torch` (or torch.anything) fails as
        # it does where torch is not installed.
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r} (hidden by test_bench)", name=name)
            return None


    sys.meta_path.insert(0, _NoTorch())
    """
)


@pytest.fixture
def no_torch_env(tmp_path: Path) -> dict[str, str]:
    """An environment in which no Python process can import torch."""
    (tmp_path / "sitecustomize.py").write_text(HIDE_TORCH)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("SHMQ_VLLM", None)
    return env


def test_torch_is_hidden(no_torch_env: dict[str, str], tmp_path: Path) -> None:
    """The hiding works (else the test below would prove nothing), also in a process
    spawned the way the bench spawns its children, and numpy still imports."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        textwrap.dedent(
            """
            import multiprocessing


            def can_import_torch(results=None):
                try:
                    import torch  # noqa: F401
                except ImportError:
                    found = False
                else:
                    found = True
                if results is not None:
                    results.put(found)
                return found


            if __name__ == "__main__":
                import numpy  # noqa: F401

                ctx = multiprocessing.get_context("spawn")
                results = ctx.Queue()
                child = ctx.Process(target=can_import_torch, args=(results,))
                child.start()
                print(can_import_torch(), results.get(timeout=60))
                child.join()
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(probe)], env=no_torch_env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_bench_without_torch(no_torch_env: dict[str, str]) -> None:
    """A short ``--quick`` run with a column and a floor row that need torch: every
    other row is measured, the table is printed, the skipped ones say what they need."""
    cmd = [
        sys.executable,
        "-m",
        "shmq",
        "bench",
        "--quick",
        "--no-progress",
        "--rounds=300",
        "--warmup=30",
        "--transports=shmq,torch.mp,iceoryx2",  # torch.mp needs torch: its column is skipped
        "--scenarios=latency,fresh16_1,encoder_cache,step_two_nodes",
    ]
    out = subprocess.run(cmd, env=no_torch_env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    text = out.stdout
    assert out.returncode == 0, f"exit code {out.returncode}\n{text}\n{out.stderr}"
    lines = text.splitlines()
    # The table: its header, its rule, and measured rows.
    header = next(i for i, line in enumerate(lines) if line.startswith("scenario"))
    assert lines[header].split()[1:4] == ["shmq", "torch.mp", "iceoryx2"], lines[header]
    assert set(lines[header + 1]) <= {"-", " "}, lines[header + 1]
    latency = next(line for line in lines if line.startswith("one-way latency, small object, p50"))
    # shmq and iceoryx2 measured, torch.mp skipped
    assert latency.count("µs") == 2 and "skipped" in latency, latency
    fresh = next(line for line in lines if line.startswith("16 MiB fresh numpy array per send"))
    assert fresh.count("GB/s") == 2, fresh
    assert any(line.startswith("encoder cache: save") and " ms" in line for line in lines), text
    # The two-node step (a remote reader over TCP): shmq's send measured, the others not its kind.
    paced = "two nodes: send of a 64-request step to 1 local + 1 remote reader, paced, p50"
    step = next(line for line in lines if line.startswith(paced))
    assert step.count("µs") == 1, step
    assert "failed" not in text, text
    # What the skipped ones need, one line per group.
    assert "note: the tensor rows send float32 numpy arrays (needs torch: pip install 'shmq[torch]'" in text
    skipped = lines[lines.index("skipped (not failures):") + 1 :]
    needs_torch = "needs torch: pip install 'shmq[torch]'"
    assert any("torch.mp (every row)" in line and needs_torch in line for line in skipped), skipped
    # The encoder-cache floor's rows that need torch (torch.multiprocessing's; vLLM's
    # connector, which needs vLLM too) say so; its shmq rows were measured (above).
    assert any("torch.multiprocessing" in line and needs_torch in line for line in skipped), skipped
    assert any("encoder cache hand-off rows" in line and "vLLM 0.33" in line for line in skipped), skipped


def test_iceoryx2_moves_objects_to_two_readers_intact(tmp_path: Path) -> None:
    """The iceoryx2 transport, through the bench's harness and roles, in spawned
    processes: N small objects to 2 readers (each checks it got exactly N, and the
    first), then numbered 1 MiB arrays (past the publisher's first segment: it grows)
    that each reader copies out and checks at both ends, in order."""
    pytest.importorskip("iceoryx2")
    from shmq_bench.harness import Harness, Job
    from shmq_bench.roles import _role_reader, _role_tensor_reader, _role_tensor_writer, _role_writer
    from shmq_bench.transports import Iceoryx2Transport

    transport = Iceoryx2Transport()
    assert transport.unavailable() is None
    harness = Harness(multiprocessing.get_context("spawn"), str(tmp_path), timeout=120)

    n = 3000
    channels = (harness.channel(transport, 2),)
    jobs = [Job(_role_writer, channels, {"n": n})]
    jobs += [Job(_role_reader, channels, {"n": n, "rank": r}) for r in range(2)]
    t0, *ends = harness.run(transport, jobs)
    assert len(ends) == 2 and all(t_end > t0 for t_end in ends)

    channels = (harness.channel(transport, 2),)
    kwargs = {"n": 20, "warmup": 2, "nbytes": 1 << 20, "fresh": True, "lib": "numpy"}
    jobs = [Job(_role_tensor_writer, channels, kwargs)]
    jobs += [Job(_role_tensor_reader, channels, {**kwargs, "rank": r}) for r in range(2)]
    writer, *ends = harness.run(transport, jobs)
    assert len(writer["send_ns"]) == 20 and all(end["t_end"] > writer["t0"] for end in ends)
    # The split of the writer's time per send: the new array, the send, the drop.
    assert len(writer["make_ns"]) == len(writer["drop_ns"]) == 20 and min(writer["make_ns"]) > 0
    # Each reader's copy floor, timed right after the row (fresh rows).
    assert all(len(end["floor_ns"]) == 5 and min(end["floor_ns"]) > 0 for end in ends)


@pytest.mark.parametrize("nbytes", [1 << 20, 4 << 20])
def test_the_loaned_rows_split_the_writers_time_and_say_how_each_loan_went(tmp_path: Path, nbytes: int) -> None:
    """The loaned tensor rows' writer (shmq, 2 readers in their own processes) times the
    loan call, the fill, the send and the drop of every measured send, and the queue's
    counters say how the loans went: under ``LOAN_SEAL_MIN`` copied, from it on sent by
    reference (sealed); every reader got every message (its end is after the start)."""
    from shmq import _core
    from shmq_bench.harness import Harness, Job
    from shmq_bench.roles import _role_tensor_reader, _role_tensor_writer
    from shmq_bench.transports import ShmqTransport

    harness = Harness(multiprocessing.get_context("spawn"), str(tmp_path), timeout=120)
    channels = (harness.channel(ShmqTransport(), 2),)
    kwargs = {"n": 12, "warmup": 2, "nbytes": nbytes, "fresh": True, "lib": "numpy"}
    jobs = [Job(_role_tensor_writer, channels, {**kwargs, "loan": True})]
    jobs += [Job(_role_tensor_reader, channels, {**kwargs, "rank": r}) for r in range(2)]
    writer, *ends = harness.run(ShmqTransport(), jobs)
    assert all(end["t_end"] > writer["t0"] for end in ends)
    for key in ("loan_ns", "fill_ns", "send_ns", "drop_ns"):
        assert len(writer[key]) == 12 and min(writer[key]) > 0, key
    assert writer["loan_fallbacks"] == 0
    sealed = nbytes >= _core.LOAN_SEAL_MIN
    assert (writer["loaned_parts"], writer["copied_parts"]) == ((14, 0) if sealed else (0, 14))


def test_iceoryx2_unavailable_says_what_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where iceoryx2 cannot be imported, its column is skipped with the install hint."""
    from shmq_bench.transports import ICEORYX2_HINT, Iceoryx2Transport

    monkeypatch.setitem(sys.modules, "iceoryx2", None)  # `import iceoryx2` raises ImportError
    assert Iceoryx2Transport().unavailable() == ICEORYX2_HINT


def test_bench_not_installed_says_how_to_install_it() -> None:
    """``python -m shmq bench`` (with the bench's options) where ``shmq_bench`` cannot be
    imported: one line on stderr that names the extra and the checkout's command, no
    traceback, a non-zero exit; ``--help`` says the same."""
    from shmq.__main__ import BENCH_MISSING

    hide = "import sys; sys.modules['shmq_bench'] = None; from shmq.__main__ import main; sys.exit(main(sys.argv[1:]))"
    runs = [(["bench", "--quick", "--scenarios", "latency", "--repeat", "2"], "stderr"), (["bench", "-h"], "stdout")]
    for args, where in runs:
        out = subprocess.run([sys.executable, "-c", hide, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
        if where == "stderr":
            assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)
            assert out.stderr.splitlines() == [BENCH_MISSING], out.stderr
            assert out.stdout == ""
        else:
            assert out.returncode == 0, out.stderr
            assert " ".join(out.stdout.split()).count(" ".join(BENCH_MISSING.split())) == 1, out.stdout
    assert "pip install 'shmq[bench]'" in BENCH_MISSING and "pip install '.[bench]' ./bench" in BENCH_MISSING
    # Other subcommands still reject what they do not know.
    out = subprocess.run([sys.executable, "-c", hide, "top", "--quick"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and "unrecognized arguments: --quick" in out.stderr, out.stderr


def test_bench_distribution_is_shmqs_version() -> None:
    """bench/pyproject.toml's version is shmq's (bindings/python/Cargo.toml, whence maturin
    takes it), it requires that shmq, and
    shmq's ``[bench]`` extra requires exactly that shmq-bench."""
    import tomllib

    shmq_version = tomllib.loads((ROOT / "bindings" / "python" / "Cargo.toml").read_text())["package"]["version"]
    bench = tomllib.loads((ROOT / "bench" / "pyproject.toml").read_text())["project"]
    shmq = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert bench["name"] == "shmq-bench" and bench["version"] == shmq_version, bench["version"]
    assert f"shmq=={shmq_version}" in bench["dependencies"], bench["dependencies"]
    assert shmq["optional-dependencies"]["bench"] == [f"shmq-bench=={shmq_version}"]


def test_the_images_scenario_takes_the_embeddings_width_and_refuses_others() -> None:
    """``--mm-width`` picks the real-sized Llava of ``--scenarios engine-mm`` (its own
    model directory per width, made by scripts/engine.sh from SHMQ_ENGINE_REAL_LLAVA);
    another width is refused by the parser, before any engine starts."""
    from shmq_bench import engine

    assert engine.real_llava() == "engine-llava-real"
    assert engine.real_llava(4096) == "engine-llava-real-4096"
    with pytest.raises(ValueError, match="2048 or 4096 wide, not 1024"):
        engine.real_llava(1024)
    cmd = [sys.executable, "-m", "shmq", "bench", "--scenarios", "engine-mm", "--mm-width", "1024"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--mm-width: invalid choice: 1024" in done.stderr
    script = (Path(__file__).parents[2] / "scripts" / "engine.sh").read_text()
    assert 'real_width=4096 real=target/engine-llava-real-4096' in script
