"""Is the metric sane? FD/KID/precision/recall for cases whose order is known in advance.

On the dataset's reference images (digits: all 1,797; Fashion-MNIST: the 60k train split),
two disjoint subsets A and B of N images each, with equal class counts (as `steadydiff eval`
picks real images for class-conditional samples):

- real vs real: A vs B (should be near zero: the floor at this N);
- real vs slightly blurred: A vs B blurred with a Gaussian (sigma 0.5 and 1.0 pixels);
- real vs noise: A vs uniform noise in [-1, 1], and vs smoothed noise;

expected order: real < blur 0.5 < blur 1.0 < noise, for FD and KID; precision/recall near
the real-vs-real values for real data and near 0 for noise. The feature network's test
accuracy is printed with the table. No sampling: seconds once the feature network is cached.

    python bench/eval_sanity.py --dataset digits --image-size 16 --num 800,200,128
    python bench/eval_sanity.py --dataset fashion_mnist --image-size 16 --num 5000,200
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import env_info, print_table  # noqa: E402


def blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    r = max(1, int(3 * sigma + 0.5))
    t = torch.arange(-r, r + 1, dtype=torch.float32)
    k = torch.exp(-t**2 / (2 * sigma**2))
    k = k / k.sum()
    c = x.shape[1]
    x = F.pad(x, (r, r, r, r), mode="replicate")
    x = F.conv2d(x, k.view(1, 1, 1, -1).expand(c, 1, 1, -1), groups=c)
    return F.conv2d(x, k.view(1, 1, -1, 1).expand(c, 1, -1, 1), groups=c)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", default="digits", choices=["digits", "fashion_mnist"])
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--path", default=None, help="fashion_mnist: folder of the idx files")
    p.add_argument("--num", default="800,128", help="comma list of N (images per side)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    from steadydiff.eval import metrics
    from steadydiff.eval.features import embed, feature_extractor, labelled_splits

    fx = feature_extractor(a.dataset, a.image_size, path=a.path)
    import numpy as np
    from steadydiff.eval.evaluate import reference_subset
    xref, yref = labelled_splits(a.dataset, a.image_size, a.path)[4:]
    g = torch.Generator().manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    out = {"bench": "eval_sanity", "dataset": a.dataset, "image_size": a.image_size,
           "feature_net": fx.meta, "rows": []}
    for n in (int(v) for v in a.num.split(",") if v):
        # two disjoint subsets with equal class counts, as `steadydiff eval` compares
        # class-conditional samples with real images
        ia = reference_subset(yref.numpy(), np.arange(n) % 10, n, rng)
        ib = reference_subset(yref.numpy(), np.arange(n) % 10, n, rng, exclude=ia)
        xa, xb = xref[torch.from_numpy(ia)], xref[torch.from_numpy(ib)]
        noise = torch.rand(xb.shape, generator=g) * 2 - 1
        cases = {"real vs real (disjoint)": xb,
                 "real vs blurred (sigma 0.5 px)": blur(xb, 0.5),
                 "real vs blurred (sigma 1.0 px)": blur(xb, 1.0),
                 "real vs smoothed noise": blur(noise, 1.0).clamp(-1, 1) * 2,
                 "real vs uniform noise": noise}
        fa = embed(fx.net, xa)[0]
        for name, xb_ in cases.items():
            r = metrics.compare(fa, embed(fx.net, xb_.clamp(-1, 1))[0], seed=a.seed)
            out["rows"].append({"case": name, "num": n, **r})
    print(f"FD-{fx.name}: feature network v{fx.meta['version']} at {a.image_size}px, test "
          f"accuracy {fx.meta['test_accuracy']:.1%} ({fx.meta['num_test']} test images)")
    print_table([[r["case"], r["num"], f"{r['fd']:.3f}", f"{r['kid']:.4f}",
                  f"{r['precision']:.3f}", f"{r['recall']:.3f}"] for r in out["rows"]],
                ["case", "N", "FD", "KID", "precision", "recall"])
    if a.json:
        print(json.dumps({**out, **env_info()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
