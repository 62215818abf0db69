"""benchmarks/peers/vllm_peer.py without a GPU: both engines get the same prompt ids and settings,
a missing or failing vLLM is said in one line while pagedllm's side still runs, and the harness's
subprocess path measures a peer (here a stand-in ``vllm`` package over pagedllm, on a tiny CPU
model)."""

from __future__ import annotations

import contextlib
import importlib.util
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import Qwen3Config

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "peers" / "vllm_peer.py"
_spec = importlib.util.spec_from_file_location("vllm_peer", SCRIPT)
vllm_peer = sys.modules["vllm_peer"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vllm_peer)


def _w1_prompts_by_the_readme(n: int) -> list[list[int]]:
    """benchmarks/README.md's recipe for W1, written out independently of workloads.py."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    return prompts[:n]


def test_both_engines_run_the_same_prompt_ids_lengths_and_settings(monkeypatch):
    seen = []

    def fake_run_child(engine, spec, args, log_path):
        seen.append((engine, spec))
        return {"output_tok_s": 1.0}

    monkeypatch.setattr(vllm_peer, "run_child", fake_run_child)
    args = vllm_peer.parse_args(["--workloads", "W1", "--num-prompts", "5", "--repeats", "2"])
    runs = vllm_peer.run_offline("W1", ["pagedllm", "vllm"], args, problems={}, out_dir=Path("/nowhere"))
    # Alternating: pagedllm first, then vLLM first.
    assert [engine for engine, _ in seen] == ["pagedllm", "vllm", "vllm", "pagedllm"]
    specs = [spec for _, spec in seen]
    assert all(spec == specs[0] for spec in specs)
    assert specs[0]["prompts"] == _w1_prompts_by_the_readme(5)
    assert specs[0]["output_len"] == 256
    settings = specs[0]["settings"]
    assert settings["max_num_seqs"] == 256 and settings["max_num_batched_tokens"] == 16384
    assert settings["model"].endswith("benchmarks/configs/qwen3-0.6b")
    assert settings["load_format"] == "dummy" and settings["skip_tokenizer_init"]
    assert len(runs["pagedllm"]) == len(runs["vllm"]) == 2


def test_the_servers_get_the_same_limits():
    settings = vllm_peer.workload_settings("W4")
    mine = vllm_peer.server_command("pagedllm", settings, 1)
    peer = vllm_peer.server_command("vllm", settings, 2)
    assert mine[1:3] == ["-m", "pagedllm"] and peer[1:3] == ["-m", "vllm.entrypoints.cli.main"]
    # The same flags but the port, and vLLM told to skip the tokenizer the directory lacks.
    assert [f for f in peer if f != "--skip-tokenizer-init"][4:-1] == mine[4:-1]
    assert "--skip-tokenizer-init" in peer
    limits = (("--max-num-seqs", "256"), ("--max-num-batched-tokens", "4096"), ("--max-model-len", "1536"))
    for flag, value in limits:
        assert peer[peer.index(flag) + 1] == value == mine[mine.index(flag) + 1]


def test_vllm_site_shadows_the_image_for_the_peer_alone(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/image/extra")
    peer = vllm_peer.engine_env("vllm", "/tmp/vllm-site")["PYTHONPATH"].split(":")
    mine = vllm_peer.engine_env("pagedllm", "/tmp/vllm-site")["PYTHONPATH"].split(":")
    assert peer == ["/tmp/vllm-site", str(REPO), "/image/extra"]
    assert mine == [str(REPO), "/image/extra"]


def test_a_failing_vllm_import_is_one_line(tmp_path):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("raise ImportError('libcudart.so.13: cannot open')\n")
    version, problem = vllm_peer.peer_version(str(tmp_path))
    assert version is None and problem == "import vllm failed: ImportError: libcudart.so.13: cannot open"
    assert vllm_peer.peer_version(str(tmp_path / "absent"))[1].startswith("no vllm in ")


def _failing_vllm(site: Path) -> str:
    """A ``vllm`` package that imports but cannot start an engine or a server."""
    (site / "vllm" / "entrypoints" / "cli").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(
        "class LLM:\n    def __init__(self, **kwargs):\n        raise RuntimeError('no CUDA device')\n"
        "SamplingParams = dict\n__version__ = '0.26.0'\n"
    )
    for package in ("entrypoints", "entrypoints/cli"):
        (site / "vllm" / package / "__init__.py").write_text("")
    (site / "vllm" / "entrypoints" / "cli" / "main.py").write_text(
        "import sys\nprint('ValueError: No valid attention backend found')\nsys.exit(1)\n"
    )
    return str(site)


def test_a_peer_failing_to_start_is_one_line_per_run(tmp_path, capsys):
    site = _failing_vllm(tmp_path)
    args = vllm_peer.parse_args(["--workloads", "W1", "--num-prompts", "1", "--vllm-site", site])
    runs = vllm_peer.run_offline("W1", ["vllm"], args, problems={}, out_dir=tmp_path)
    error = runs["vllm"][0]["error"]
    assert error.startswith("exit 1: RuntimeError: no CUDA device (log: ")
    assert capsys.readouterr().out == f"W1: vllm failed: {error}\n"
    assert "Traceback" in (tmp_path / "w1_vllm_0.log").read_text()


def test_a_run_past_its_timeout_is_ended_with_its_subprocesses(tmp_path):
    # An engine that starts a worker of its own (as vLLM's engine core) and then hangs.
    (tmp_path / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text(
        "import subprocess, time\n"
        "class LLM:\n"
        "    def __init__(self, **kwargs):\n"
        f"        worker = subprocess.Popen(['sleep', '600'])\n"
        f"        open({str(tmp_path / 'worker.pid')!r}, 'w').write(str(worker.pid))\n"
        "        time.sleep(600)\n"
        "SamplingParams = dict\n__version__ = '0.26.0'\n"
    )
    args = vllm_peer.parse_args(["--vllm-site", str(tmp_path / "site"), "--timeout", "3"])
    spec = vllm_peer.offline_spec("W3", args)
    result = vllm_peer.run_child("vllm", spec, args, tmp_path / "w3.log")
    assert result == {"error": f"no result within 3 s (log: {tmp_path / 'w3.log'})"}
    worker = Path(f"/proc/{int((tmp_path / 'worker.pid').read_text())}/stat")

    def ended() -> bool:  # gone, or a zombie its new parent has yet to reap: it holds nothing
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            return worker.read_text().rsplit(")", 1)[1].split()[0] == "Z"
        return True

    # SIGKILL is delivered at once but a loaded machine may take a moment to run the exit.
    deadline = time.monotonic() + 5
    while not ended() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ended()


def test_a_server_failing_to_start_is_one_line(tmp_path):
    site = _failing_vllm(tmp_path / "site")
    args = vllm_peer.parse_args(["--workloads", "W4", "--vllm-site", site, "--timeout", "60"])
    result = vllm_peer.run_serve("vllm", args, tmp_path, repeat=0)
    assert result == {"error": "server exited with 1: ValueError: No valid attention backend found"}


def test_the_table_marks_an_unmeasured_peer_and_gives_no_ratio():
    result = {
        "versions": {"pagedllm": "0.1.0"},
        "device": "NVIDIA H100 80GB HBM3",
        "date": "2026-11-27",
        "repeats": 1,
        "problems": {"vllm": "no vllm in /tmp/vllm-site"},
        "workloads": {
            "W1": {"pagedllm": [{"output_tok_s": 30000.0}], "vllm": []},
            "W3": {"pagedllm": [{"ms_per_token": 6.1}], "vllm": []},
            "W4": {"pagedllm": [{"rates": [{"request_rate": 32.0, "p99_ttft_ms": 90.0,
                                             "p99_tpot_ms": 12.0, "lost": 0}]}], "vllm": []},
        },
    }  # fmt: skip
    text = vllm_peer.table(result)
    missing = "not measured (no vllm in /tmp/vllm-site)"
    assert f"| W1 | output tok/s | 30,000.00 | {missing} | - | >= 1.1 |" in text
    assert f"| W3 | ms/token | 6.10 | {missing} | - | <= 0.9 |" in text
    assert f"| W4 @32.0/s | p99 TTFT ms | 90.0 | {missing} | - | <= 1.0 |" in text
    assert "vLLM not run" in text


def test_ratios_are_pagedllm_over_vllm():
    result = {
        "versions": {"pagedllm": "0.1.0", "vllm": "0.26.0"}, "device": "d", "date": "t", "repeats": 2,
        "problems": {},
        "workloads": {"W1": {"pagedllm": [{"output_tok_s": 33.0}, {"output_tok_s": 35.0}],
                             "vllm": [{"output_tok_s": 30.0}, {"error": "exit 1: boom"}]}},
    }  # fmt: skip
    assert "| W1 | output tok/s | 34.00 | 30.00 | 1.13x | >= 1.1 |" in vllm_peer.table(result)


def _sitting(workloads: dict, device: str = "NVIDIA H200", problems: dict | None = None) -> dict:
    return {"versions": {"pagedllm": "0.1.0", "vllm": "0.26.0"}, "device": device, "date": "2026-11-29",
            "repeats": 1, "command": "vllm_peer.py", "problems": problems or {},
            "workloads": workloads}  # fmt: skip


def test_sittings_of_one_machine_merge_into_one_table_and_plot(tmp_path):
    first = _sitting({"W1": {"pagedllm": [{"output_tok_s": 33.0}], "vllm": [{"output_tok_s": 30.0}]}})
    second = _sitting({"W1": {"pagedllm": [{"output_tok_s": 35.0}], "vllm": [{"output_tok_s": 30.0}]},
                       "W3": {"pagedllm": [{"ms_per_token": 4.5}], "vllm": []}},
                      problems={"vllm": "no vllm in /tmp/vllm-site"})  # fmt: skip
    paths = []
    for i, sitting in enumerate((first, second)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(vllm_peer.json.dumps(sitting))
    out_json, out_png = tmp_path / "merged.json", tmp_path / "merged.png"
    outputs = ["--output-json", str(out_json), "--output-png", str(out_png)]
    merged = vllm_peer.main(["--merge", *map(str, paths), *outputs])
    assert merged["workloads"]["W1"]["pagedllm"] == [{"output_tok_s": 33.0}, {"output_tok_s": 35.0}]
    assert merged["command"] == ["vllm_peer.py", "vllm_peer.py"]
    text = vllm_peer.table(merged)
    assert "| W1 | output tok/s | 34.00 | 30.00 | 1.13x | >= 1.1 |" in text
    assert "| W3 | ms/token | 4.50 | not measured (no vllm in /tmp/vllm-site) | - | <= 0.9 |" in text
    assert vllm_peer.json.loads(out_json.read_text()) == merged
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sittings_on_different_devices_do_not_merge():
    with pytest.raises(ValueError, match="different devices"):
        vllm_peer.merge([_sitting({}, "NVIDIA H200"), _sitting({}, "NVIDIA H100 80GB HBM3")])


@pytest.fixture
def tiny_model(tmp_path) -> str:
    """A Qwen3 config small enough for the CPU, with W1's token ids (< 10,001) in its vocabulary."""
    config = Qwen3Config(
        vocab_size=10240, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
    )  # fmt: skip
    config.save_pretrained(tmp_path / "tiny")
    return str(tmp_path / "tiny")


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), "--workloads", "W1", "--num-prompts", "1", "--output-len", "2"]
    cmd += ["--out-dir", str(tmp_path / "out"), "--output-json", str(tmp_path / "r.json"), *args]
    env = {**vllm_peer.os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_a_missing_peer_is_one_line_and_pagedllm_still_runs(tiny_model, tmp_path):
    done = _run(["--model", tiny_model, "--vllm-site", str(tmp_path / "nowhere")], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    said = [line for line in done.stdout.splitlines() if "vllm" in line.lower() and not line.startswith("|")]
    assert said == [f"vLLM peer unavailable, running pagedllm only: no vllm in {tmp_path / 'nowhere'} "
                    "(scripts/install_peer.sh installs it there)", "pagedllm 0.1.0 against vLLM not run on "
                    f"{vllm_peer._device()}, " + said[1].split(", ", 1)[1]]  # fmt: skip
    row = next(line for line in done.stdout.splitlines() if line.startswith("| W1 |"))
    mine = row.split("|")[3].strip()
    assert float(mine.replace(",", "")) > 0 and "not measured" in row.split("|")[4]


@pytest.mark.slow
def test_a_peer_is_measured_through_its_own_subprocess(tiny_model, tmp_path):
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    # A stand-in with vLLM's offline API, over pagedllm: the harness cannot tell the difference.
    stand_in = 'from pagedllm import LLM, SamplingParams\n__version__ = "stand-in"\n'
    (site / "vllm" / "__init__.py").write_text(stand_in)
    done = _run(["--model", tiny_model, "--vllm-site", str(site)], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("| W1 |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert float(cells[2].replace(",", "")) > 0 and float(cells[3].replace(",", "")) > 0
    assert cells[4].endswith("x")
    assert "against vLLM stand-in" in done.stdout
