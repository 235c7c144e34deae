"""kvo-plan: numbers checked by hand on a small made-up model, presets, and bad arguments."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvo_core.cli import human_bytes, main

# A small MLA + indexer model: latent 60 + rope 4 = 64 bf16 values = 128 B per token and layer,
# indexer key 16 bf16 = 32 B per token and layer, 4 layers, no MTP.
TINY = {"num_hidden_layers": 4, "kv_lora_rank": 60, "qk_rope_head_dim": 4,
        "index_n_heads": 2, "index_head_dim": 16, "index_topk": 32}
# 250 tokens in blocks of 16 -> 16 blocks = 256 token slots per request; 2 requests -> 512.
TINY_ARGS = ["--seq-len", "250", "--concurrency", "2", "--block-size", "16",
             "--hot-capacity", "64", "--shared-buffers", "2", "--independent-layers", "none",
             "--miss-rate", "0.25"]


@pytest.fixture
def tiny_model(tmp_path: Path) -> str:
    path = tmp_path / "tiny" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(TINY))
    return str(path)


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main([*argv, "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    result: dict[str, Any] = json.loads(out)
    return result


def test_json_matches_hand_computation(capsys: pytest.CaptureFixture[str],
                                       tiny_model: str) -> None:
    report = run_json(capsys, "--model", tiny_model, *TINY_ARGS)
    tokens = 2 * 256
    full = 4 * tokens * (128 + 32)  # 327680
    assert report["model"]["main_bytes_per_token_decode_rank"] == 128
    assert report["model"]["indexer_bytes_per_token"] == 32
    assert report["inputs"]["top_k"] == 32  # from the model's index_topk
    assert report["no_offload"]["prefill_rank"] == {"device_bytes": full, "host_bytes": 0}
    assert report["no_offload"]["decode_rank"] == {"device_bytes": full, "host_bytes": 0}

    layerwise = report["layerwise_prefill"]
    assert layerwise["physical_buffers"] == 2  # I + min(B, N - I) = 0 + min(2, 4)
    assert layerwise["slots"] == [[0, 2], [1, 3]]
    assert layerwise["footprint_ratio"] == pytest.approx(0.5)
    assert layerwise["device_bytes"] == 2 * tokens * 160
    assert layerwise["host_bytes"] == full

    sparse = report["sparse_decode"]
    assert sparse["indexer_device_bytes"] == 4 * tokens * 32  # 65536
    assert sparse["hot_buffer_device_bytes"] == 2 * 64 * 4 * 128  # rows x capacity x layers x row
    assert sparse["device_bytes"] == 65536 + 65536
    assert sparse["host_bytes"] == 4 * tokens * 128  # 262144
    assert sparse["device_ratio"] == pytest.approx((65536 + 65536) / full)
    assert sparse["main_kv_device_ratio"] == pytest.approx(65536 / (4 * tokens * 128))
    step = sparse["per_step_transfer"]
    assert step["row_bytes"] == 128
    assert step["worst_case_bytes"] == 2 * 4 * 32 * 128  # rows x layers x top-k x row
    assert step["expected_bytes"] == 2 * 4 * 32 * 128 // 4  # 25% miss rate
    assert step["full_reload_bytes"] == 2 * 4 * 256 * 128
    assert step["append_bytes"] == 2 * 4 * 128
    assert report["sparse_decode_not_applicable"] is None


def test_table_shows_the_same_numbers(capsys: pytest.CaptureFixture[str],
                                      tiny_model: str) -> None:
    assert main(["--model", tiny_model, *TINY_ARGS]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()

    def row(label: str) -> str:
        return next(line for line in lines if line.startswith(label))

    assert row("no offload, prefill rank").split()[-4:] == ["320.00", "KiB", "0", "B"]
    assert row("layerwise prefill offload").split()[-4:] == ["160.00", "KiB", "320.00", "KiB"]
    assert "128.00 KiB" in row("sparse decode offload") and "256.00 KiB" in row("sparse decode")
    assert "2 physical buffers for 4 layers" in out
    assert "footprint ratio 0.5000" in out
    assert "device KV ratio offload/none 0.4000 (main KV alone 0.2500)" in out
    assert "32.00 KiB" in row("  worst case")
    assert "12.50% of full reload" in row("  worst case")
    assert "256.00 KiB" in row("  full-layer reload")
    assert "replicated on every TP rank" in out


@pytest.mark.parametrize(("shared", "independent", "expected"), [
    ("1", "0", 2), ("2", "0", 3), ("4", "0,-1", 6), ("100", "0", 62), ("3", "all", 62),
    ("2", "none", 2), ("8", "0,1,2", 11),
])
def test_physical_buffers_formula(capsys: pytest.CaptureFixture[str], shared: str,
                                  independent: str, expected: int) -> None:
    report = run_json(capsys, "--shared-buffers", shared,
                      f"--independent-layers={independent}")
    layerwise = report["layerwise_prefill"]
    n = layerwise["num_layers"]
    i = len(layerwise["independent"])
    assert n == 62  # DeepSeek-V3.2: 61 layers + 1 MTP layer
    assert layerwise["physical_buffers"] == i + min(int(shared), n - i) == expected
    assert layerwise["footprint_ratio"] == pytest.approx(expected / n)
    full = report["no_offload"]["prefill_rank"]["device_bytes"]
    assert layerwise["device_bytes"] * n == full * expected


def test_default_preset_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "deepseek-v3.2: 61 layers + 1 MTP" in out
    assert "3 physical buffers for 62 layers" in out
    # 16 x 131072 tokens x 62 layers x (1152 + 256) B = 170.50 GiB; main KV alone 139.50 GiB
    assert "170.50 GiB" in out and "139.50 GiB" in out
    assert "8.25 GiB" in out  # 3 of 62 layer buffers


def test_dense_model_has_no_sparse_decode(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, "--model", "llama-3.1-8b", "--prefill-tp", "2", "--decode-tp", "2")
    assert report["sparse_decode"] is None
    assert "no sparse-attention indexer" in report["sparse_decode_not_applicable"]
    # 8 KV heads sharded over TP 2: 2 x 4 x 128 x 2 B = 2048 B per token and layer
    assert report["model"]["main_bytes_per_token_prefill_rank"] == 2048
    assert report["no_offload"]["prefill_rank"]["device_bytes"] == 16 * 131072 * 32 * 2048
    assert main(["--model", "llama-3.1-8b"]) == 0
    assert "not applicable" in capsys.readouterr().out


def test_mla_is_replicated_across_tp(capsys: pytest.CaptureFixture[str], tiny_model: str) -> None:
    one = run_json(capsys, "--model", tiny_model, *TINY_ARGS)
    four = run_json(capsys, "--model", tiny_model, *TINY_ARGS,
                    "--prefill-tp", "4", "--decode-tp", "2")
    assert four["no_offload"] == one["no_offload"]
    assert four["inputs"]["tp_ratio"] == 2
    assert any("contribution groups of 2" in note for note in four["notes"])


def test_int8_indexer_and_no_mtp(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, "--indexer-dtype", "int8", "--no-mtp")
    assert report["model"]["cache_layers"] == 61
    assert report["model"]["indexer_bytes_per_token"] == 128 + 2


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--seq-len", "0"], "--seq-len: expected a positive integer, got '0'"),
    (["--concurrency", "many"], "--concurrency: expected a positive integer"),
    (["--model", "no-such-model"], "neither a preset"),
    (["--prefill-tp", "2", "--decode-tp", "4"], "prefill TP size 2 and decode TP size 4"),
    (["--hot-capacity", "1000"], "hot_capacity must be >= top_k (2048)"),
    (["--hot-capacity", "4000"], "hot_capacity must be a multiple of block_size (128)"),
    (["--hot-capacity", "40000"], "hot_capacity must be an integer in [1, 32640]"),
    (["--independent-layers", "99"], "independent_layers entry 99 is not a planned layer"),
    (["--independent-layers=x"], "--independent-layers: expected 'all', 'none'"),
    (["--model", "llama-3.1-8b", "--prefill-tp", "3", "--decode-tp", "3"], "TP size 3"),
    (["--miss-rate", "1.5"], "--miss-rate: expected a number in [0, 1]"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--indexer-dtype", "fp8"], "invalid choice: 'fp8'"),
])
def test_bad_arguments_one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str],
                                       fragment: str) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("kvo-plan: error: ")
    assert fragment in err
    assert "Traceback" not in err


def test_bad_config_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    broken = tmp_path / "config.json"
    broken.write_text("[1, 2")
    assert main(["--model", str(broken)]) == 2
    assert "is not a JSON config.json" in capsys.readouterr().err
    broken.write_text(json.dumps({"num_hidden_layers": 2}))
    assert main(["--model", str(tmp_path)]) == 2
    assert "missing 'num_attention_heads'" in capsys.readouterr().err


def test_human_bytes() -> None:
    assert human_bytes(0) == "0 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(1536) == "1.50 KiB"
    assert human_bytes(3 * 1024**3) == "3.00 GiB"


def _console_script() -> str:
    beside = Path(sys.executable).parent / "kvo-plan"
    found = str(beside) if beside.exists() else shutil.which("kvo-plan")
    if found is None:
        pytest.skip("the kvo-plan console script is not installed in this environment")
    return found


def test_installed_console_script(tiny_model: str) -> None:
    script = _console_script()
    good = subprocess.run([script, "--model", tiny_model, *TINY_ARGS, "--json"],
                          capture_output=True, text=True, timeout=120)
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["layerwise_prefill"]["physical_buffers"] == 2
    bad = subprocess.run([script, "--decode-tp", "3", "--prefill-tp", "4"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stdout == ""
    assert bad.stderr.startswith("kvo-plan: error: prefill TP size 4 and decode TP size 3")
    assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
