"""Video data: frame sampling by hand, decoding a video written here with PyAV, frame folders, the two layouts, the
views of evaluation, one set of augmentation parameters per clip, and the error contract."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from PIL import Image

from attnlab.data.video import build_video, sample_indices, video_info
from attnlab.errors import AttnlabError, DatasetError



def _normalised_to_pixels(x):
    return (x * 0.225 + 0.45) * 255


def write_video(path, values, size=(16, 16)):
    """A grey clip whose frame i is the constant ``values[i]`` (MPEG-4 Part 2, in PyAV's own FFmpeg)."""
    av = pytest.importorskip("av")  # the `test` extra installs it
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.height, stream.width = size
        stream.pix_fmt = "yuv420p"
        for v in values:
            frame = av.VideoFrame.from_ndarray(np.full((*size, 3), v, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


def write_frames(folder, values, size=(16, 16), start=1, name="img_{:05d}.png"):
    folder.mkdir(parents=True)
    for i, v in enumerate(values):
        Image.fromarray(np.full(size, v, np.uint8)).save(folder / name.format(start + i))
    return folder


# ---- sampling ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length, frames, view, views, want", [
    (16, 8, 0, 1, [1, 3, 5, 7, 9, 11, 13, 15]),   # segments of 2, their centres
    (10, 4, 0, 1, [1, 3, 6, 8]),                  # 2.5-frame segments: 1.25, 3.75, 6.25, 8.75
    (4, 8, 0, 1, [0, 0, 1, 1, 2, 2, 3, 3]),       # shorter than T: each frame twice, in order
    (12, 3, 0, 2, [1, 5, 9]),                     # view 0 of 2: a quarter into each 4-frame segment
    (12, 3, 1, 2, [3, 7, 11]),                    # view 1 of 2: three quarters in
    (1, 3, 0, 1, [0, 0, 0]),
])
def test_uniform_sampling_by_hand(length, frames, view, views, want):
    assert sample_indices(length, frames, view=view, views=views) == want


def test_training_sampling_jitters_within_each_segment():
    g = torch.Generator().manual_seed(0)
    seen = [set() for _ in range(4)]
    for _ in range(200):
        picks = sample_indices(20, 4, train=True, generator=g)
        for t, i in enumerate(picks):
            assert 5 * t <= i < 5 * (t + 1)
            seen[t].add(i)
    assert all(s == set(range(5 * t, 5 * t + 5)) for t, s in enumerate(seen))  # every frame of a segment drawn
    with pytest.raises(DatasetError, match="no frames"):
        sample_indices(0, 8)


# ---- decoding and layouts ------------------------------------------------------------------------------------------
def test_decodes_a_video_written_here_at_the_sampled_frames(tmp_path):
    (tmp_path / "train" / "a").mkdir(parents=True)
    write_video(tmp_path / "train" / "a" / "clip.mp4", [20 * i for i in range(12)])
    ds = build_video(True, data_dir=tmp_path, num_frames=4, image_size=16, in_chans=1)
    clip, label = ds[0]
    assert clip.shape == (1, 4, 16, 16) and label == 0
    got = _normalised_to_pixels(clip).mean(dim=(0, 2, 3))
    torch.testing.assert_close(got, torch.tensor([20.0, 80.0, 140.0, 200.0]), atol=4, rtol=0)  # frames 1, 4, 7, 10


def test_frame_folders_in_both_layouts(tmp_path):
    for split, cls, clip, base in (("train", "jump", "c1", 0), ("train", "walk", "c2", 100), ("val", "walk", "c3", 50)):
        write_frames(tmp_path / split / cls / clip, [base + 10 * i for i in range(6)], start=0)
    info = video_info(tmp_path, num_frames=3, image_size=16, in_chans=1)
    assert info.classes == ("jump", "walk") and info.num_classes == 2 and info.num_frames == 3
    val = build_video(False, data_dir=tmp_path, num_frames=3, image_size=16, in_chans=1, crops=1)
    clip, label = val[0]
    assert label == 1
    torch.testing.assert_close(_normalised_to_pixels(clip).mean(dim=(0, 2, 3)), torch.tensor([60.0, 80.0, 100.0]),
                               atol=1e-3, rtol=0)  # 6 frames, 3 segments of 2: frames 1, 3, 5

    lists = tmp_path / "cs"
    lists.mkdir()
    (lists / "train.csv").write_text("train/jump/c1,0\ntrain/walk/c2,1\n")
    (lists / "test.txt").write_text("val/walk/c3 1\n\n")
    ds = build_video(False, data_dir=tmp_path, lists="cs", num_frames=3, image_size=16, in_chans=1, crops=1)
    assert [c.label for c in ds.clips] == [1] and ds.classes == ("0", "1")
    (lists / "train.csv").write_text("train/jump/c1,jump\ntrain/walk/c2,walk\n")
    (lists / "test.txt").write_text("val/walk/c3 walk\n")
    assert build_video(False, data_dir=tmp_path, lists="cs", num_frames=3, image_size=16, in_chans=1).classes == \
        ("jump", "walk")


def test_evaluation_views_are_clips_times_crops(tmp_path):
    ramp = np.tile(np.arange(32, dtype=np.uint8) * 8, (16, 1))  # 16 x 32, value 8 x column
    folder = tmp_path / "val" / "a" / "c"
    folder.mkdir(parents=True)
    for i in range(1, 9):
        Image.fromarray(ramp).save(folder / f"{i:03d}.png")
    ds = build_video(False, data_dir=tmp_path, num_frames=2, image_size=16, in_chans=1, clips=2, crops=3)
    views, _ = ds[0]
    assert views.shape == (6, 1, 2, 16, 16)
    first_column = _normalised_to_pixels(views[:3, 0, 0, :, 0]).mean(dim=1)
    torch.testing.assert_close(first_column, torch.tensor([0.0, 64.0, 128.0]), atol=1e-3, rtol=0)  # left, centre, right
    torch.testing.assert_close(views[3:], views[:3])  # the second temporal clip of still frames: the same crops


def test_one_set_of_augmentation_parameters_per_clip(tmp_path):
    rng = np.random.default_rng(0)
    still = rng.integers(0, 255, (20, 24), dtype=np.uint8)
    folder = tmp_path / "train" / "a" / "c"
    folder.mkdir(parents=True)
    for i in range(1, 5):
        Image.fromarray(still).save(folder / f"{i}.png")
    ds = build_video(True, data_dir=tmp_path, augment="recipe", num_frames=4, image_size=16, in_chans=1)
    outs = []
    for seed in range(6):
        torch.manual_seed(seed)
        clip, _ = ds[0]
        assert clip.shape == (1, 4, 16, 16)
        assert all(torch.equal(clip[:, 0], clip[:, t]) for t in range(4))  # same crop, scale and flip every frame
        outs.append(clip)
    assert len({tuple(o.flatten()[:20].tolist()) for o in outs}) > 1  # the parameters do change between clips


# ---- the error contract --------------------------------------------------------------------------------------------
def test_errors_name_the_file_and_what_would_be_right(tmp_path):
    build = lambda root, train=True, **kw: build_video(train, data_dir=root, num_frames=2, image_size=8,  # noqa
                                                       in_chans=1, **kw)
    gap = write_frames(tmp_path / "gap" / "train" / "a" / "c", [0, 1, 2, 3])
    (gap / "img_00003.png").unlink()
    with pytest.raises(DatasetError, match="gap: frame 3 is missing"):
        build(tmp_path / "gap")

    (tmp_path / "bad" / "train" / "a").mkdir(parents=True)
    (tmp_path / "bad" / "train" / "a" / "bad.mp4").write_bytes(b"\x00not a video" * 50)
    with pytest.raises(DatasetError, match="bad.mp4 cannot be opened"):
        build(tmp_path / "bad")
    with pytest.raises(DatasetError, match="bad.mp4 cannot be decoded"):
        build(tmp_path / "bad", verify=False)[0]

    root = tmp_path / "ok"
    write_frames(root / "train" / "a" / "ok", [0, 1, 2])
    write_frames(root / "val" / "b" / "c", [0, 1])
    with pytest.raises(DatasetError, match="not a class of the training split"):
        build(root, train=False)
    (root / "train.csv").write_text("train/a/ok 0\n")
    for listed, error in (("train/a/ok 0\ntrain/a/ok 3\n", "line 2: label 3 is outside the 1 classes"),
                          ("train/a/ok walk\n", "line 1: label 'walk' is not one of"),
                          ("train/a/missing 0\n", "line 1: .*missing does not exist"),
                          ("train/a/ok\n", "line 1 has 1 fields")):
        (root / "val.csv").write_text(listed)
        with pytest.raises(DatasetError, match=error):
            build(root, train=False)
    with pytest.raises(AttnlabError, match="unknown option frames"):
        build_video(False, data_dir=root, frames=2)
    with pytest.raises(DatasetError, match="does not exist"):
        video_info(tmp_path / "nowhere")


def test_without_pyav_video_files_ask_for_the_extra(tmp_path, monkeypatch):
    (tmp_path / "train" / "a").mkdir(parents=True)
    (tmp_path / "train" / "a" / "c.mp4").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "av", None)  # import av fails as if not installed
    with pytest.raises(DatasetError, match=r"pip install 'attnlab\[video\]'"):
        build_video(True, data_dir=tmp_path)


def test_unnumbered_and_doubled_frames(tmp_path):
    write_frames(tmp_path / "train" / "a" / "c", [0, 1], name="frame{}.png")
    Image.fromarray(np.zeros((16, 16), np.uint8)).save(tmp_path / "train" / "a" / "c" / "cover.png")
    with pytest.raises(DatasetError, match="cover.png has no frame number"):
        build_video(True, data_dir=tmp_path, num_frames=2, image_size=8, in_chans=1)
    (tmp_path / "train" / "a" / "c" / "cover.png").unlink()
    Image.fromarray(np.zeros((16, 16), np.uint8)).save(tmp_path / "train" / "a" / "c" / "frame001.jpg")
    with pytest.raises(DatasetError, match="holds frame 1 twice"):
        build_video(True, data_dir=tmp_path, num_frames=2, image_size=8, in_chans=1)
