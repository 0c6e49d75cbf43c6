"""The device-resident data pipeline against torchvision's and timm's transforms (tests/reference_augment.py).

Equality: every AutoAugment op, crop, flip, erasing and mixing given the same parameters equals the reference
exactly (uint8 ops are exact integer results, including the colour ops: each group of samples goes through
torchvision's own op with a scalar magnitude, and sharpness's integer form is exact, see its docstring);
normalised floats are compared bit for bit too. Distributions: frequencies over many draws with a fixed seed,
within 5 binomial standard deviations (a false failure about once in 10^6 per check).
"""

import math
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from torch.utils._python_dispatch import TorchDispatchMode

from attnlab.data import device_pipeline as dp
from attnlab.errors import AttnlabError, ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reference_augment as ref  # noqa: E402

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Many small ops: one thread avoids OpenMP's hand-offs, which cost 100x on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def images(n, seed=0, size=32):
    """Random uint8 images; a quarter low-contrast and one constant, for autocontrast's and equalize's edge cases."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)
    x[: n // 4] = x[: n // 4] // 4 + 90
    x[-1] = 17
    return x


def within(count, n, p, sigmas=5.0):
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p)) + 1


# ---------------------------------------------------------------------------------------------- tables
def test_policy_table_is_torchvisions():
    aa = T.AutoAugment(T.AutoAugmentPolicy.CIFAR10)
    assert [tuple(map(tuple, sub)) for sub in dp.CIFAR10_POLICY] == [tuple(map(tuple, s)) for s in aa.policies]
    assert aa.policies == aa._get_policies(T.AutoAugmentPolicy.CIFAR10)


@pytest.mark.parametrize("size", [(32, 32), (24, 40)])
def test_magnitude_table_is_torchvisions(size):
    space = T.AutoAugment()._augmentation_space(10, size)
    for op, (mags, signed) in space.items():
        ours, our_signed = dp.magnitudes(op, *size)
        expected = tuple(mags.tolist() if mags.ndim else [0.0] * 10)
        assert (ours, our_signed) == (expected, signed), op


# ---------------------------------------------------------------------------------------------- per-op equality
def _policy_ops():
    """Every (op, signed magnitude) the CIFAR10 policy can apply, from torchvision's own tables."""
    space = T.AutoAugment()._augmentation_space(10, (32, 32))
    out = set()
    for sub in T.AutoAugment(T.AutoAugmentPolicy.CIFAR10).policies:
        for name, _, bin_ in sub:
            mags, signed = space[name]
            m = float(mags[bin_]) if bin_ is not None else 0.0
            out |= {(name, m), (name, -m)} if signed else {(name, m)}
    return sorted(out)


@pytest.mark.parametrize("op,magnitude", _policy_ops())
def test_each_op_equals_torchvision_on_a_batch(op, magnitude):
    from torchvision.transforms.autoaugment import _apply_op

    x = images(12)
    want = torch.stack([_apply_op(img, op, magnitude, interpolation=T.InterpolationMode.NEAREST, fill=None)
                        for img in x])
    assert torch.equal(dp.apply_op(x.clone(), op, magnitude), want)


@pytest.mark.parametrize("factor", [0.1, 0.5, 1.0, 1.3, 1.9])
def test_sharpness_equals_torchvision(factor):
    import torchvision.transforms.functional as TF

    x = images(16, seed=3, size=11)
    assert torch.equal(dp.adjust_sharpness(x, factor), torch.stack([TF.adjust_sharpness(i, factor) for i in x]))


def test_auto_augment_per_sample_equals_torchvision():
    n = 250  # about 10 samples per sub-policy, so every op of the policy is hit
    x = images(n, seed=1)
    rng = np.random.default_rng(0)
    p = dp.draw_params(rng, n, 32, 32, dp.AugmentRecipe())
    got = dp.auto_augment(x.clone(), p["policy"], p["op_u"], p["op_sign"])
    for k in range(n):
        want = ref.auto_augment(x[k], p["policy"][k], p["op_u"][k], p["op_sign"][k])
        assert torch.equal(got[k], want), k
    assert set(p["policy"].tolist()) == set(range(25))


def test_crop_flip_equals_torchvision():
    x = images(64, seed=2).float()  # any dtype: the float path of digits
    g = torch.Generator().manual_seed(0)
    i, j = torch.randint(0, 9, (64,), generator=g), torch.randint(0, 9, (64,), generator=g)
    flip = torch.rand(64, generator=g) < 0.5
    got = dp.crop_flip(x, i, j, flip.nonzero().squeeze(1), 4, fill=-1.5)
    for k in range(64):
        assert torch.equal(got[k], ref.crop_flip(x[k], int(i[k]), int(j[k]), bool(flip[k]), 4, fill=-1.5)), k


def test_random_erase_equals_torchvision():
    x = torch.randn(32, 3, 32, 32)
    rng = np.random.default_rng(1)
    p = dp.draw_params(rng, 32, 32, 32, dp.AugmentRecipe(random_erasing=0.7))
    box = [torch.from_numpy(p[k]) for k in ("erase_i", "erase_j", "erase_h", "erase_w")]
    got = dp.random_erase(x.clone(), *box)
    for k in range(32):
        assert torch.equal(got[k], ref.erase(x[k], *(int(b[k]) for b in box))), k


# a CutMix lam is already corrected to the box: 1 - 14 * 16 / 1024 and 1 - 32 * 24 / 1024
@pytest.mark.parametrize("lam,box", [(1.0, None), (0.62, None), (0.78125, (3, 17, 0, 16)), (0.25, (0, 32, 8, 32))])
def test_mix_batch_equals_timm(lam, box):
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    got_x, got_y = dp.mix_batch(x.clone(), y, lam, box, 10, 0.1)
    want_x, want_y = ref.mix(x, y, lam, box, num_classes=10, smoothing=0.1)
    assert torch.equal(got_x, want_x) and torch.allclose(got_y, want_y, rtol=0, atol=1e-7)


@pytest.mark.parametrize("lam", [0.05, 0.3, 0.5, 0.77, 0.99])
@pytest.mark.parametrize("cy,cx", [(0, 0), (5, 30), (16, 16), (31, 2)])
def test_cutmix_box_equals_timms(lam, cy, cx):
    from unittest import mock

    from timm.data.mixup import cutmix_bbox_and_lam

    with mock.patch("numpy.random.randint", side_effect=[cy, cx]):
        (yl, yh, xl, xh), want = cutmix_bbox_and_lam((8, 3, 32, 32), lam)
    assert dp.cutmix_box(lam, cy, cx, 32, 32) == (want, (yl, yh, xl, xh))


# ---------------------------------------------------------------------------------------------- the whole pipeline
def test_pipeline_equals_the_recipe_sample_by_sample():
    """Every batch of one epoch equals crop, flip, AutoAugment, normalise, erase, then timm's Mixup/CutMix, image by
    image through the references, with the parameters drawn in the pipeline's documented order."""
    n, batch, seed, epoch = 96, 8, 5, 2
    x, labels = images(n, seed=4), torch.arange(n) % 10
    recipe = dp.AugmentRecipe(mix_prob=0.8)  # more mixed batches in a short epoch
    pipe = dp.DevicePipeline(x, labels, num_classes=10, batch_size=batch, mean=MEAN, std=STD, recipe=recipe,
                             seed=seed, repeated_aug=3, chunk=48)
    got = list(pipe.epoch(epoch))
    order = dp.epoch_order(n, seed, epoch, repeated_aug=3)
    rng = np.random.default_rng([seed, epoch, 0])
    kinds = Counter()
    assert len(got) == len(order) // batch
    for c in range(0, len(got) * batch, 48):
        idx = order[c:c + 48]
        p = dp.draw_params(rng, len(idx), 32, 32, recipe)
        imgs = []
        for k, s in enumerate(idx.tolist()):
            img = ref.crop_flip(x[s], int(p["crop_i"][k]), int(p["crop_j"][k]), bool(p["flip"][k]), 4)
            img = ref.auto_augment(img, p["policy"][k], p["op_u"][k], p["op_sign"][k])
            img = ref.to_normalised(img, MEAN, STD)
            imgs.append(ref.erase(img, *(int(p[f"erase_{q}"][k]) for q in "ijhw")))
        for b in range(0, len(idx), batch):
            lam, box = dp.draw_mix(rng, 32, 32, recipe)
            kinds["none" if lam == 1.0 else "cutmix" if box else "mixup"] += 1
            want_x, want_y = ref.mix(torch.stack(imgs[b:b + batch]), labels[idx[b:b + batch]], lam, box,
                                     num_classes=10, smoothing=0.1)
            out = got[(c + b) // batch]
            assert torch.equal(out.labels, labels[idx[b:b + batch]])
            assert torch.allclose(out.images, want_x, rtol=0, atol=1e-6)
            assert torch.allclose(out.targets, want_y, rtol=0, atol=1e-7)
    assert kinds["mixup"] and kinds["cutmix"] and kinds["none"]  # every branch was compared


def test_sample_order_is_the_cpu_loaders():
    """repeated_aug > 1 visits images in the order of attnlab.train's timm RepeatAugSampler, seeded per epoch."""
    from timm.data.distributed_sampler import RepeatAugSampler

    from attnlab.train.loop import epoch_seed

    n, seed, epoch = 1000, 3, 7
    sampler = RepeatAugSampler(range(n), num_replicas=1, rank=0, shuffle=True, num_repeats=3)
    sampler.set_epoch(epoch_seed(seed, epoch))
    order = dp.epoch_order(n, seed, epoch, repeated_aug=3)
    assert order.tolist() == list(sampler)
    assert len(order) == 768  # timm keeps the epoch length: 1000 rounded down to a multiple of 256
    runs = order.view(-1, 3)
    assert (runs == runs[:, :1]).all() and len(set(runs[:, 0].tolist())) == 256  # each image 3 times in a row


def test_ranks_split_the_epoch():
    n = 1024
    orders = [dp.epoch_order(n, 0, 1, repeated_aug=3, num_replicas=2, rank=r) for r in range(2)]
    assert len(orders[0]) == len(orders[1]) == 512
    joined = torch.stack(orders, 1).reshape(-1)  # interleaved back: the single-process epoch
    assert torch.equal(joined, dp.epoch_order(n, 0, 1, repeated_aug=3))
    plain = [dp.epoch_order(n, 0, 1, num_replicas=2, rank=r) for r in range(2)]
    assert sorted(torch.cat(plain).tolist()) == list(range(n))


# ---------------------------------------------------------------------------------------------- distributions
def test_parameter_frequencies_match_the_recipe():
    n = 100_000
    r = dp.AugmentRecipe()
    p = dp.draw_params(np.random.default_rng(0), n, 32, 32, r)
    for key in ("crop_i", "crop_j"):
        counts = np.bincount(p[key], minlength=9)
        assert len(counts) == 9 and all(within(c, n, 1 / 9) for c in counts), key
    assert within(p["flip"].sum(), n, 0.5)
    policy_counts = np.bincount(p["policy"], minlength=25)
    assert len(policy_counts) == 25 and all(within(c, n, 1 / 25) for c in policy_counts)
    for k, sub in enumerate(dp.CIFAR10_POLICY):  # each op of each sub-policy fires with its probability
        rows = p["policy"] == k
        for stage, (_, prob, _) in enumerate(sub):
            fired = (p["op_u"][rows, stage] <= prob).sum()
            assert within(fired, rows.sum(), prob), (k, stage)
            assert within((p["op_sign"][rows, stage] == 1).sum(), rows.sum(), 0.5)


def test_erasing_matches_torchvision_random_erasing():
    """How often a box is drawn and the mean box height and width, against RandomErasing.get_params itself."""
    n, r = 20_000, dp.AugmentRecipe()
    p = dp.draw_params(np.random.default_rng(1), n, 32, 32, r)
    torch.manual_seed(0)
    img = torch.zeros(3, 32, 32)
    boxes = np.array([T.RandomErasing.get_params(img, scale=r.erasing_scale, ratio=r.erasing_ratio, value=[0])[:4]
                      for _ in range(n)])
    fits = boxes[:, 2] < 32  # get_params returns the whole image when no attempt fits
    erased = p["erase_h"] > 0
    assert within(erased.sum(), n, r.random_erasing * fits.mean())
    for ours, theirs in ((p["erase_h"][erased], boxes[fits, 2]), (p["erase_w"][erased], boxes[fits, 3]),
                         (p["erase_i"][erased], boxes[fits, 0])):
        sd = math.sqrt(theirs.var() / len(ours) + theirs.var() / len(theirs))
        assert abs(ours.mean() - theirs.mean()) <= 5 * sd
    assert (p["erase_i"] + p["erase_h"] <= 32).all() and (p["erase_j"] + p["erase_w"] <= 32).all()


def test_mix_frequencies_match_timm():
    """P(mixed) = mix_prob, P(CutMix | mixed) = switch_prob, and lam's mean for each kind, against timm's draws."""
    from timm.data import Mixup
    from timm.data.mixup import cutmix_bbox_and_lam

    n, r = 20_000, dp.AugmentRecipe()
    rng = np.random.default_rng(2)
    ours = [dp.draw_mix(rng, 32, 32, r) for _ in range(n)]
    mixer = Mixup(mixup_alpha=r.mixup, cutmix_alpha=r.cutmix, prob=r.mix_prob, switch_prob=r.switch_prob,
                  mode="batch", label_smoothing=0.1, num_classes=10)
    np.random.seed(0)
    theirs = []
    for _ in range(n):
        lam, cut = mixer._params_per_batch()
        theirs.append((cutmix_bbox_and_lam((32, 32), lam)[1], True) if cut else (lam, False))
    ours = [(lam, box is not None) for lam, box in ours]
    for kind in (False, True):
        a = np.array([lam for lam, c in ours if c == kind and (c or lam != 1.0)])
        b = np.array([lam for lam, c in theirs if c == kind and (c or lam != 1.0)])
        assert within(len(a), n, r.mix_prob * (r.switch_prob if kind else 1 - r.switch_prob))
        assert abs(a.mean() - b.mean()) <= 5 * math.sqrt(a.var() / len(a) + b.var() / len(b)), kind


# ---------------------------------------------------------------------------------------------- seeds and resume
def _epoch(pipe, e):
    return [tuple(t.clone() for t in b) for b in pipe.epoch(e)]


def test_same_seed_and_epoch_give_the_same_batches_after_resume():
    x, y = images(120, seed=6), torch.arange(120) % 10
    make = lambda **k: dp.DevicePipeline(x, y, num_classes=10, batch_size=20, mean=MEAN, std=STD,  # noqa: E731
                                         recipe=dp.AugmentRecipe(), seed=11, repeated_aug=3, chunk=60, **k)
    run = make()
    epochs = {e: _epoch(run, e) for e in (1, 2, 3)}
    resumed = make()  # a new process resuming at epoch 3
    again = _epoch(resumed, 3)
    assert all(torch.equal(a, b) for ba, bb in zip(epochs[3], again) for a, b in zip(ba, bb))
    assert not torch.equal(epochs[2][0][0], epochs[3][0][0])
    other_rank = _epoch(make(num_replicas=2, rank=1), 3)
    assert not torch.equal(other_rank[0][0], epochs[3][0][0])
    other_seed = dp.DevicePipeline(x, y, num_classes=10, batch_size=20, mean=MEAN, std=STD, recipe=dp.AugmentRecipe(),
                                   seed=12, repeated_aug=3, chunk=60)
    assert not torch.equal(_epoch(other_seed, 3)[0][0], epochs[3][0][0])


def test_cpu_threads_split_the_chunk_without_changing_it():
    x, y = images(200, seed=7), torch.arange(200) % 10
    pipe = dp.DevicePipeline(x, y, num_classes=10, batch_size=20, mean=MEAN, std=STD, recipe=dp.AugmentRecipe(),
                             seed=1, chunk=100)
    one = _epoch(pipe, 1)
    torch.set_num_threads(3)  # the module's fixture restores the count
    try:
        three = _epoch(pipe, 1)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(1)
    assert all(torch.equal(a, b) for ba, bb in zip(one, three) for a, b in zip(ba, bb))


class DeviceWaits(TorchDispatchMode):
    """What would make a CUDA chunk copy from the host or wait for the device, seen at the dispatcher on the CPU:
    a tensor made from host data with elements (``aten.lift_fresh``: ``torch.tensor(list)``, ``torch.from_numpy``;
    a 0-dim one is a scalar that kernels take by value, no copy) and a read of device values on the host
    (``aten._local_scalar_dense``: ``.item()``, ``bool()``, ``int()``) or an op whose output size depends on them."""

    READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique2", "aten.unique_dim")

    def __init__(self):
        super().__init__()
        self.transfers, self.reads = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if name == "aten.lift_fresh" and out.dim() > 0:
            self.transfers.append(tuple(out.shape))
        if name in self.READS or (name == "aten.index" and any(
                t is not None and t.dtype == torch.bool for t in args[1])):
            self.reads.append(name)
        return out


def test_a_chunk_moves_its_parameters_in_one_transfer_and_never_reads_the_device():
    """Per chunk: one copy from the host (indices, crop, flip, erasing, AutoAugment's groups and affine matrices),
    and no host read of device values anywhere in the epoch (on CUDA each would block the host)."""
    x, y = images(96, seed=8), torch.arange(96) % 10
    pipe = dp.DevicePipeline(x, y, num_classes=10, batch_size=16, mean=MEAN, std=STD, seed=3, chunk=48,
                             recipe=dp.AugmentRecipe(mix_prob=1.0, random_erasing=0.5))  # every batch mixed
    with DeviceWaits() as seen:
        batches = list(pipe.epoch(1))
    assert len(batches) == 6
    assert seen.reads == []
    assert len(seen.transfers) == 2  # one per chunk of 48
    p = dp.draw_params(np.random.default_rng(0), 500, 32, 32, dp.AugmentRecipe())
    with DeviceWaits() as seen:  # every op of the policy, each in many groups
        dp.auto_augment(images(500), p["policy"], p["op_u"], p["op_sign"])
    assert seen.reads == [] and len(seen.transfers) == 1


def test_float_images_and_no_mixing_give_hard_labels():
    x, y = torch.randn(40, 1, 8, 8), torch.arange(40) % 10
    recipe = dp.AugmentRecipe(crop_padding=1, flip=0.0, auto_augment=False, random_erasing=0.0, mix_prob=0.0)
    pipe = dp.DevicePipeline(x, y, num_classes=10, batch_size=8, recipe=recipe, pad_value=-0.8)
    batches = list(pipe.epoch(0))
    assert len(batches) == 5 and batches[0].targets.dtype == torch.int64
    assert torch.equal(batches[0].targets, batches[0].labels)
    plain = list(dp.DevicePipeline(x, y, num_classes=10, batch_size=8).epoch(0))
    order = dp.epoch_order(40, 0, 0)
    assert torch.equal(torch.cat([b.images for b in plain]), x[order])  # no recipe: the images untouched


@pytest.mark.parametrize("kwargs,match", [
    (dict(images=torch.randn(8, 3, 4, 4)), "uint8"),
    (dict(batch_size=7), "even"),
    (dict(batch_size=64), "larger than"),
    (dict(rank=2, num_replicas=2), "rank"),
    (dict(recipe=dp.AugmentRecipe(flip=1.5)), "probability"),
])
def test_user_mistakes_are_one_sentence_errors(kwargs, match):
    args = dict(images=images(40), labels=list(range(40)), num_classes=40, batch_size=8, recipe=dp.AugmentRecipe())
    args.update(kwargs)
    with pytest.raises(AttnlabError, match=match) as err:
        dp.DevicePipeline(args.pop("images"), args.pop("labels"), **args)
    assert isinstance(err.value, ConfigError) and "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------- from a dataset name
def test_build_cifar_holds_uint8_and_serves_the_cpu_datasets_images(tmp_path):
    from test_data_cifar import write_cifar10

    from attnlab.data import build_dataset

    write_cifar10(tmp_path)
    pipe = dp.build_device_pipeline("cifar10", data_dir=tmp_path, verify_md5=False, device="cpu", batch_size=2,
                                    seed=0, augment="none", mix_prob=0.0)
    assert pipe.images.dtype == torch.uint8 and pipe.images.shape == (10, 3, 32, 32)
    cpu = build_dataset("cifar10", True, data_dir=tmp_path, verify_md5=False)
    order = dp.epoch_order(10, 0, 4)
    got = list(pipe.epoch(4))
    assert len(got) == 5
    for b, batch in enumerate(got):
        for k in range(2):
            image, label = cpu[int(order[2 * b + k])]
            assert torch.allclose(batch.images[k], image, rtol=0, atol=1e-6) and int(batch.labels[k]) == label
    recipe = dp.build_device_pipeline("cifar10", data_dir=tmp_path, verify_md5=False, device="cpu", batch_size=2,
                                      seed=0, random_erasing=0.5, auto_augment=False)
    assert recipe.recipe == dp.AugmentRecipe(auto_augment=False, random_erasing=0.5)


def test_build_digits_shifts_like_the_cpu_dataset():
    from attnlab.data import build_dataset

    pipe = dp.build_device_pipeline("digits", device="cpu", batch_size=16, seed=0, mix_prob=0.0)
    cpu = build_dataset("digits", True, augment="recipe")
    order = dp.epoch_order(len(cpu), 0, 1)
    batch = next(iter(pipe.epoch(1)))
    shifts = Counter()
    for k in range(16):
        window = cpu.padded[int(order[k]), :]
        hits = [(dy, dx) for dy in range(3) for dx in range(3) if torch.equal(batch.images[k],
                                                                            window[:, dy:dy + 8, dx:dx + 8])]
        assert hits, k  # one of build_digits' 9 windows, its padding included
        shifts[hits[0]] += 1
    assert len(shifts) > 1


def test_build_synthetic_and_refuse_imagefolder():
    from attnlab.data import build_dataset
    from attnlab.errors import DatasetError

    pipe = dp.build_device_pipeline("synthetic", device="cpu", batch_size=8, seed=0, length=32, mix_prob=0.0)
    cpu = build_dataset("synthetic", True, length=32)
    order = dp.epoch_order(32, 0, 2)
    assert torch.equal(torch.cat([b.images for b in pipe.epoch(2)]), torch.stack([cpu[int(i)][0] for i in order]))
    with pytest.raises(DatasetError, match="CPU loader"):
        dp.build_device_pipeline("imagefolder", device="cpu", batch_size=8, seed=0)
