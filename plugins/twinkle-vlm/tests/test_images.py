"""Image files before decoding: the pixel limit read from the header (decompression bombs), PIL's own guard, sizes the
processor refuses, and confinement of image paths to a root."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import warnings
import zlib
from types import SimpleNamespace

import pytest
from PIL import Image, ImageFile
from twinkle_vlm.data import VLMDataError, VLMSample, load_samples
from twinkle_vlm.images import (
    DEFAULT_MAX_IMAGE_PIXELS,
    ImageFileError,
    check_image_root,
    check_max_image_pixels,
    image_problem,
    open_image,
)
from twinkle_vlm.processor import image_size_refusal
from twinkle_vlm.task import VLMEncoder, VLMTask
from twinkle_vlm.testing import tiny_processor

from twinkle_core.errors import ConfigError, DataFormatError

#: PIL warns about the 144 Mpixel test images at Image.open, before the header check refuses them
pytestmark = pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def bomb_png(path, width: int, height: int, *, pixels: bool = True) -> str:
    """A 1-bit black PNG of ``width`` x ``height``: 12000 x 12000 (144 Mpixel) is 17 KB on disk, 432 MB as RGB.
    ``pixels=False`` writes the header only (PIL's own guard refuses at the header)."""
    data = b""
    if pixels:
        row = b"\x00" * (1 + (width + 7) // 8)  # filter byte + the packed row
        compressor = zlib.compressobj(9)
        data = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
                + _chunk(b"IDAT", data) + _chunk(b"IEND", b""))
    return str(path)


def _png(path, size=(32, 24)) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new("RGB", size, (200, 30, 30)).save(path)
    return str(path)


def _row(image: str) -> dict:
    return {"messages": [{"role": "user", "content": "<image>What is it?"},
                         {"role": "assistant", "content": "A square."}], "images": [image]}


def _jsonl(path, rows) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


@pytest.fixture
def no_decoding(monkeypatch):
    """Fail the test if any pixel is decoded."""
    def load(self):
        raise AssertionError(f"decoded {self.size}")
    monkeypatch.setattr(ImageFile.ImageFile, "load", load)


# ------------------------------------------------------------------ max_image_pixels: refused from the header


def test_a_header_declaring_too_many_pixels_is_refused_before_decoding(tmp_path, no_decoding):
    bomb = bomb_png(tmp_path / "bomb.png", 12000, 12000)
    assert os.path.getsize(bomb) < 20_000
    with pytest.raises(ImageFileError) as info:
        open_image(bomb)
    message = str(info.value)
    assert isinstance(info.value, DataFormatError)
    for part in (bomb, "12000x12000", "144,000,000 pixels", f"max_image_pixels={DEFAULT_MAX_IMAGE_PIXELS:,}"):
        assert part in message
    assert image_problem(bomb) == message
    # the limit is the caller's: a small one refuses a small image the same way
    small = _png(tmp_path / "small.png", (40, 30))
    assert "40x30 (1,200 pixels), more than max_image_pixels=1,000" in image_problem(small, max_image_pixels=1000)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak RSS (VmHWM) from /proc")
def test_the_refused_bomb_costs_no_memory(tmp_path):
    """In a fresh process: before the fix, opening this 17 KB file decoded 144 Mpixel (700 MiB peak RSS; 2.3 GiB
    through the task's encoding); refused at the header it stays at the interpreter's own footprint."""
    bomb = bomb_png(tmp_path / "bomb.png", 12000, 12000)
    # VmHWM (not getrusage's ru_maxrss, which a child started by fork keeps from its parent across exec)
    script = ("import re, sys\n"
              "from twinkle_vlm.images import ImageFileError, open_image\n"
              "try:\n    open_image(sys.argv[1])\nexcept ImageFileError:\n    print('refused')\n"
              "print(int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) // 1024)\n")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", script, bomb], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    assert out[0] == "refused"
    assert int(out[1]) < 150, f"peak RSS {out[1]} MiB"


def test_pil_own_guard_is_reported_as_an_image_error(tmp_path, monkeypatch):
    # a header declaring 30000 x 30000: PIL's Image.open raises DecompressionBombError (over 2 x its limit)
    huge = bomb_png(tmp_path / "huge.png", 30000, 30000, pixels=False)
    with pytest.raises(ImageFileError) as info:
        open_image(huge)
    assert "too large for PIL to open" in str(info.value) and "900000000 pixels" in str(info.value)
    assert f"at most max_image_pixels={DEFAULT_MAX_IMAGE_PIXELS:,}" in str(info.value)

    # PIL's process-wide limit below ours: its error and (under -W error) its warning name PIL's setting
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    over_twice = _png(tmp_path / "over_twice.png", (50, 50))      # 2500 > 2 x 1000: DecompressionBombError
    over_once = _png(tmp_path / "over_once.png", (40, 40))        # 1600 > 1000: DecompressionBombWarning
    problem = image_problem(over_twice, max_image_pixels=10**6)
    assert "PIL.Image.MAX_IMAGE_PIXELS (now 1,000)" in problem and "max_image_pixels=1,000,000" in problem
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with pytest.raises(ImageFileError, match="PIL.Image.MAX_IMAGE_PIXELS"):
            open_image(over_once, max_image_pixels=10**6)
    with pytest.warns(Image.DecompressionBombWarning):  # a warning only: max_image_pixels decides
        assert open_image(over_once, max_image_pixels=10**6).size == (40, 40)


def test_the_data_check_reports_oversized_images_with_file_and_line(tmp_path):
    ok = _png(tmp_path / "ok.png")
    rows = [_row(ok), _row(bomb_png(tmp_path / "bomb.png", 12000, 12000)),
            _row(bomb_png(tmp_path / "huge.png", 30000, 30000, pixels=False))]
    path = _jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(VLMDataError) as info:
        load_samples(path)
    problems = {line: reason for _, line, reason in info.value.problems}
    assert sorted(problems) == [2, 3]
    assert "12000x12000" in problems[2] and "max_image_pixels" in problems[2]
    assert "too large for PIL to open" in problems[3]
    assert f"{path}:2: image {tmp_path / 'bomb.png'} is 12000x12000" in str(info.value)


def test_max_image_pixels_option_is_checked():
    assert check_max_image_pixels(None) == DEFAULT_MAX_IMAGE_PIXELS == 89_478_485
    assert check_max_image_pixels(4096) == 4096
    for bad in (0, -5, "big", 1.5, True):
        with pytest.raises(ConfigError, match="task_options.max_image_pixels"):
            check_max_image_pixels(bad)
    recipe = SimpleNamespace(task_options={"max_image_pixels": -1, "image_root": 3})
    problems = VLMTask.check_recipe(recipe)
    assert len(problems) == 2
    assert problems[0].startswith("task_options.max_image_pixels:")
    assert problems[1].startswith("task_options.image_root:")
    assert VLMTask.check_recipe(SimpleNamespace(task_options={})) == []


# ------------------------------------------------------------------ sizes the processor refuses


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl", "internvl", "gemma3"])
def test_the_data_check_refuses_sizes_the_processor_refuses(tmp_path, model_type):
    """Qwen2-VL's smart_resize refuses an aspect ratio over 200 (transformers 5.25); InternVL and Gemma 3 take
    any size. The data check asks the processor with the header's size, before any pixel is decoded."""
    processor = tiny_processor(model_type)
    rows = [_row(_png(tmp_path / "wide.png", (3000, 4))), _row(_png(tmp_path / "tall.png", (4, 3000))),
            _row(_png(tmp_path / "edge.png", (1000, 5))), _row(_png(tmp_path / "dot.png", (1, 1)))]
    path = _jsonl(tmp_path / "train.jsonl", rows)
    if not model_type.startswith("qwen"):
        assert len(load_samples(path, image_processor=processor.image_processor)) == 4
        return
    with pytest.raises(VLMDataError) as info:
        load_samples(path, image_processor=processor.image_processor)
    problems = {line: reason for _, line, reason in info.value.problems}
    assert sorted(problems) == [1, 2]  # 1000 x 5 is a ratio of exactly 200: taken
    assert "cannot take a 3000x4 image" in problems[1] and "aspect ratio must be smaller than 200" in problems[1]
    assert "cannot take a 4x3000 image" in problems[2]
    assert image_size_refusal(processor.image_processor, 1000, 5) is None
    # the answers match what the processor does with pixels
    with pytest.raises(ValueError, match="aspect ratio"):
        processor.image_processor(images=[Image.new("RGB", (3000, 4))])
    processor.image_processor(images=[Image.new("RGB", (1000, 5)), Image.new("RGB", (1, 1))])


def test_encoding_never_raises_a_raw_image_or_processor_error(tmp_path):
    """The files may change after the data check (or a caller skips it): the encoder's errors are still RowErrors
    naming the image."""
    from twinkle_core.data.formats import RowError

    encoder = VLMEncoder(tiny_processor("qwen2_5_vl"))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "x"}]}]
    gone = str(tmp_path / "gone.png")
    with pytest.raises(RowError, match=f"image file not found: {gone}"):
        encoder.encode(VLMSample(messages, [gone]))
    wide = _png(tmp_path / "wide.png", (3000, 4))
    with pytest.raises(RowError, match="the processor refused .*wide.png.*aspect ratio"):
        encoder.encode(VLMSample(messages, [wide]))
    bomb = bomb_png(tmp_path / "bomb.png", 12000, 12000)
    with pytest.raises(RowError, match="12000x12000"):
        encoder.encode(VLMSample(messages, [bomb]))


def test_the_task_reports_every_image_problem_as_file_and_line(tmp_path, tiny_vlm_dir):
    from transformers import AutoTokenizer

    model_dir = tiny_vlm_dir("qwen2_5_vl")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    root = tmp_path / "root"
    rows = [_row(_png(root / "ok.png")), _row(_png(root / "wide.png", (1000, 4))),
            _row(_png(root / "big.png", (64, 64))), _row(_png(tmp_path / "outside.png"))]
    path = _jsonl(root / "train.jsonl", rows)
    assert len(VLMTask().load_dataset(_jsonl(root / "good.jsonl", rows[:1] + rows[2:]), tokenizer)) == 3
    task = VLMTask(max_image_pixels=64 * 64 - 1, image_root=str(root))
    with pytest.raises(DataFormatError) as info:
        task.load_dataset(path, tokenizer)
    message = str(info.value)
    assert f"{path}:2: image {root / 'wide.png'}: the model's image processor" in message
    assert f"{path}:3: image {root / 'big.png'} is 64x64 (4,096 pixels), more than max_image_pixels=4,095" in message
    assert f"{path}:4: image {tmp_path / 'outside.png'} is outside image_root {root}" in message
    assert len(task.load_dataset(_jsonl(root / "ok.jsonl", rows[:1]), tokenizer)) == 1


# ------------------------------------------------------------------ image_root: confinement


@pytest.fixture
def tree(tmp_path):
    """root/data/train.jsonl and images inside and outside root, reached by relative, absolute and symlinked paths."""
    root, data = tmp_path / "root", tmp_path / "root" / "data"
    _png(data / "imgs" / "ok.png")
    _png(root / "shared.png")
    outside = _png(tmp_path / "outside.png")
    os.symlink(outside, data / "link_out.png")
    os.symlink(root / "shared.png", data / "link_in.png")
    rows = [_row("imgs/ok.png"),                  # 1 inside
            _row("../shared.png"),                # 2 inside, through ..
            _row("../../outside.png"),            # 3 outside, through ..
            _row(outside),                        # 4 outside, absolute
            _row("link_out.png"),                 # 5 a symlink inside root to a file outside
            _row("link_in.png"),                  # 6 a symlink to a file inside
            _row(str(root / "shared.png")),       # 7 absolute, inside
            _row("../../secret/missing.png")]     # 8 outside and missing: not even its absence is told
    return SimpleNamespace(root=root, outside=outside, path=_jsonl(data / "train.jsonl", rows))


def test_image_root_refuses_paths_that_resolve_outside_it(tree):
    with pytest.raises(VLMDataError) as info:
        load_samples(tree.path, image_root=str(tree.root))
    problems = {line: reason for _, line, reason in info.value.problems}
    assert sorted(problems) == [3, 4, 5, 8]
    for line in (3, 4, 5, 8):
        assert f"is outside image_root {tree.root}" in problems[line]
    assert f"(it resolves to {tree.outside})" in problems[5]
    assert "not found" not in problems[8]


def test_without_image_root_any_readable_path_works(tree):
    """The default (the CLI's): relative, absolute and symlinked paths anywhere are read as before."""
    with pytest.raises(VLMDataError) as info:
        load_samples(tree.path)
    assert [(line, reason.split(":")[0]) for _, line, reason in info.value.problems] == [(8, "image file not found")]


def test_open_image_confines_to_a_root_for_callers_such_as_a_service(tree, tmp_path):
    assert open_image(str(tree.root / "data" / "link_in.png"), root=tree.root).size == (32, 24)
    for path in (tree.outside, str(tree.root / "data" / "link_out.png"), str(tree.root / ".." / "outside.png")):
        with pytest.raises(ImageFileError, match="outside image_root"):
            open_image(path, root=tree.root)
    loop = tree.root / "loop.png"
    os.symlink(loop, loop)
    with pytest.raises(ImageFileError):
        open_image(str(loop), root=tree.root)
    with pytest.raises(ConfigError, match="image_root .* is not an existing directory"):
        check_image_root(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="is not an existing directory"):
        load_samples(tree.path, image_root=str(tree.outside))
