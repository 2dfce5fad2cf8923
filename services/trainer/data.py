"""Training data and its deterministic order.

The whole data set is a tensor in memory (digits, a small image folder, or synthetic
blobs), scaled to [-1, 1]. The order is a pure function of (seed, data position): the
global batch at position ``p`` is slice ``p % B`` of epoch ``p // B``'s permutation, and
rank ``r`` takes its ``r``-th share. So "where the data was" is one integer, a resumed run
sees exactly the batches it would have, and skipping a bad window is skipping positions.
"""

from __future__ import annotations

import stat
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem.common.runs import DataSpec


def _resize(x: torch.Tensor, size: int) -> torch.Tensor:
    if x.shape[-1] == size and x.shape[-2] == size:
        return x
    return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)


def load_digits_tensor(size: int, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled digits (1797 8x8 images, 0..16), as ``load_digits`` reads them.

    The file is read directly: importing scikit-learn costs every rank about a second.
    """
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the digits data set needs scikit-learn installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets/data/digits.csv.gz"
    table = np.loadtxt(path, delimiter=",", dtype=np.float32)
    x = torch.from_numpy(table[:, :-1].copy()).view(-1, 1, 8, 8) / 16.0  # 0..16 -> 0..1
    x = _resize(x, size).clamp(0, 1) * 2 - 1
    return x.repeat(1, channels, 1, 1), torch.from_numpy(table[:, -1].astype(np.int64))


def load_image_folder(root: str, size: int, channels: int, num_classes: int = 0,
                      data_root: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """``root/<class>/<image>``: classes are the sorted folder names.

    Refused, naming it (``ValueError``: the run's config, which the rank reports): more
    class folders than ``num_classes`` (when conditional), a class folder or image that
    resolves outside ``data_root`` (a symlink out of the trainer's ``DATA_ROOT``; empty:
    any), an image that is not a regular file (a FIFO would block the rank for ever, a
    folder named ``x.png``), and one that does not decode (truncated, not an image)."""
    from PIL import Image

    base = Path(root)
    if not base.is_dir():
        raise ValueError(f"data.path {root!r} is not a directory")
    classes = sorted(p.name for p in base.iterdir() if p.is_dir())
    if not classes:
        raise ValueError(f"data.path {root!r} has no class folders")
    if 0 < num_classes < len(classes):
        raise ValueError(f"data.path {root!r} has {len(classes)} class folders, more than "
                         f"model.num_classes ({num_classes})")
    confine = Path(data_root).resolve() if data_root else None
    mode = "L" if channels == 1 else "RGB"
    xs, ys = [], []
    for label, name in enumerate(classes):
        folder = _inside(base / name, confine)
        for f in sorted(folder.iterdir()):
            if f.suffix.lower() not in (".png", ".jpg", ".jpeg", ".bmp", ".webp"):
                continue
            if not stat.S_ISREG(_inside(f, confine).stat().st_mode):
                raise ValueError(f"data set file {str(f)!r} is not a regular file")
            try:
                with Image.open(f) as im:
                    img = im.convert(mode).resize((size, size))
            except (OSError, ValueError, Image.DecompressionBombError) as exc:
                raise ValueError(f"data set file {str(f)!r} is not a readable image: "
                                 f"{exc}") from exc
            t = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
            xs.append(t.view(size, size, channels).permute(2, 0, 1).float() / 255.0)
            ys.append(label)
    if not xs:
        raise ValueError(f"data.path {root!r} has no images")
    return torch.stack(xs) * 2 - 1, torch.tensor(ys, dtype=torch.long)


def _inside(path: Path, root: Path | None) -> Path:
    """``path``, refused when it resolves (its symlinks followed) outside ``root``."""
    if root is not None and not path.resolve().is_relative_to(root):
        raise ValueError(f"data set path {str(path)!r} leads to {str(path.resolve())!r}, "
                         f"outside the data root {str(root)!r} (TANDEM_DATA_ROOT)")
    return path


def synthetic(n: int, size: int, channels: int, classes: int, seed: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian blobs whose position encodes the class: learnable, no files needed."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, max(classes, 1), (n,), generator=g)
    grid = torch.linspace(-1, 1, size)
    yy, xx = torch.meshgrid(grid, grid, indexing="ij")
    angle = y.float() * (6.2832 / max(classes, 1))
    cx, cy = 0.5 * torch.cos(angle), 0.5 * torch.sin(angle)
    jitter = 0.05 * torch.randn(n, 2, generator=g)
    px = (cx + jitter[:, 0])[:, None, None]
    py = (cy + jitter[:, 1])[:, None, None]
    d2 = (xx - px) ** 2 + (yy - py) ** 2
    x = torch.exp(-d2 / 0.08) * 2 - 1
    return x.unsqueeze(1).repeat(1, channels, 1, 1), y


def load(spec: DataSpec, size: int, channels: int, classes: int, seed: int,
         data_root: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    if spec.kind == "digits":
        return load_digits_tensor(size, channels)
    if spec.kind == "image_folder":
        assert spec.path is not None
        return load_image_folder(spec.path, size, channels, classes, data_root)
    return synthetic(spec.synthetic_size, size, channels, classes, seed)


class BatchPlan:
    """Which samples rank ``rank`` trains on at each data position."""

    def __init__(self, n: int, per_rank: int, world: int, rank: int, seed: int) -> None:
        self.global_batch = per_rank * world
        if n < self.global_batch:
            raise ValueError(f"the data set has {n} samples, fewer than one global batch "
                             f"({per_rank} per rank x {world} ranks)")
        self.n = n
        self.per_rank = per_rank
        self.rank = rank
        self.seed = seed
        self.batches_per_epoch = n // self.global_batch
        self._epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    def indices(self, pos: int) -> torch.Tensor:
        epoch, i = divmod(pos, self.batches_per_epoch)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._perm, self._epoch = torch.randperm(self.n, generator=g), epoch
        batch = self._perm[i * self.global_batch:(i + 1) * self.global_batch]
        return batch[self.rank * self.per_rank:(self.rank + 1) * self.per_rank]


def next_position(pos: int, skipped: Sequence[Sequence[int]]) -> int:
    """The first data position >= ``pos`` outside every skipped ``[first, last]`` window."""
    moved = True
    while moved:
        moved = False
        for first, last in skipped:
            if first <= pos <= last:
                pos, moved = last + 1, True
    return pos
