"""The default VLM plan (vision frozen, projector full via ``modules_to_save``, LoRA on the language model) on 2 CPU
ranks: DDP and FSDP2 (vision blocks as their own units) give the single process's losses; DeepSpeed ZeRO-2/3 run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from twinkle_core.testing.torchrun import run_torchrun

SCRIPT = Path(__file__).parent / "scripts" / "vlm_parity.py"
#: fp32, 3 SGD steps: the ranks sum the same per-token losses in another order (relative ~1e-7 per reduction),
#: which moves the next steps' weights by lr * that; 1e-5 relative bounds it with a wide margin
RTOL = 1e-5


class Runs:
    def __init__(self, root: Path, model_dir: Path, rows: list) -> None:
        self.root, self.model_dir = root, model_dir
        self.rows = root / "rows.json"
        self.rows.write_text(json.dumps(rows))
        self.results: dict[str, dict] = {}

    def get(self, name: str, nproc: int, *args: str) -> dict:
        if name not in self.results:
            out = self.root / f"{name}.json"
            result = run_torchrun([SCRIPT, out, self.model_dir, self.rows, *args], nproc=nproc, timeout=300,
                                  env={"DS_ACCELERATOR": "cpu"})
            assert result.returncode == 0, result.output[-6000:]
            self.results[name] = json.loads(out.read_text())
        return self.results[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_vlm_dir, colour_rows) -> Runs:
    return Runs(tmp_path_factory.mktemp("vlm-parity"), tiny_vlm_dir("qwen2_5_vl"), colour_rows)


@pytest.mark.distributed
@pytest.mark.timeout(660)
@pytest.mark.parametrize("strategy", ["ddp", "native_fsdp"])
def test_two_ranks_match_one_process(runs, strategy):
    single = runs.get("single", 1)
    assert single["losses"][-1] < single["losses"][0], single
    run = runs.get(strategy, 2, "--strategy", strategy)
    assert run["world_size"] == 2 and run["dp_size"] == 2, run
    assert run["losses"] == pytest.approx(single["losses"], rel=RTOL), (run["losses"], single["losses"])
    print(f"{strategy}: losses {run['losses']} vs single {single['losses']}")
    if strategy == "native_fsdp":  # vision blocks and decoder layers are their own units
        # fully_shard turns a unit of class C into class FSDPC
        assert {"FSDPQwen2_5_VLVisionBlock", "FSDPQwen2_5_VLDecoderLayer"} <= set(run["fsdp_units"]), run["fsdp_units"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(660)
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_runs_and_matches(runs, stage):
    single = runs.get("single", 1)
    run = runs.get(f"zero{stage}", 2, "--strategy", "deepspeed", "--strategy-options", json.dumps({"stage": stage}))
    assert run["world_size"] == 2, run
    # ZeRO keeps fp32 master weights and reduces gradients in fp32 buckets: the same bound as DDP
    assert run["losses"] == pytest.approx(single["losses"], rel=RTOL), (run["losses"], single["losses"])
    print(f"zero{stage}: losses {run['losses']} vs single {single['losses']}")


@pytest.fixture(scope="module")
def video_runs(tmp_path_factory, tiny_vlm_dir) -> Runs:
    """Four chats that show a clip (a folder of 4 frames of 56 x 56 pixels: 2 temporal patches), each answered with
    the colour its clip ends on."""
    from PIL import Image

    root = tmp_path_factory.mktemp("vlm-video-parity")
    colours = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220), "white": (250, 250, 250)}
    rows = []
    for i, (last, rgb) in enumerate(colours.items()):
        frames = root / f"clip{i}"
        frames.mkdir()
        first = list(colours.values())[(i + 1) % len(colours)]
        for k, colour in enumerate([first, first, rgb, rgb]):
            Image.new("RGB", (56, 56), colour).save(frames / f"frame_{k:03d}.png")
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "video", "video": str(frames)},
                                         {"type": "text", "text": "Which colour comes last?"}]},
            {"role": "assistant", "content": last}]})
    return Runs(root, tiny_vlm_dir("qwen2_5_vl"), rows)


@pytest.mark.distributed
@pytest.mark.timeout(660)
@pytest.mark.parametrize("strategy", ["ddp", "native_fsdp"])
def test_two_ranks_train_video_rows_as_one_process(video_runs, strategy):
    """Video rows (``pixel_values_videos``, ``video_grid_thw``, temporal 3-D positions) on 2 ranks: the same bound."""
    single = video_runs.get("single", 1)
    assert single["losses"][-1] < single["losses"][0], single
    assert {"pixel_values_videos", "video_grid_thw"} <= set(single["vision_inputs"]), single
    run = video_runs.get(strategy, 2, "--strategy", strategy)
    assert run["world_size"] == 2 and run["dp_size"] == 2, run
    assert run["losses"] == pytest.approx(single["losses"], rel=RTOL), (run["losses"], single["losses"])
    print(f"{strategy} video: losses {run['losses']} vs single {single['losses']}")
