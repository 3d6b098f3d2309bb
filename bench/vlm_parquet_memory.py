"""Peak memory of reading image rows from a Parquet file whose images are a datasets Image column
(issue 47, item 17): the recipe's data path (recipes/hf_vision_run.load_image_rows: rows read,
every image decoded, examples encoded and cached in a temporary folder), then every block read
once (its pixel values made, as an epoch does), on a tiny LLaVA folder (tests/vlm_fixtures.py).

The file is written here by datasets' `Dataset.to_parquet` (tests/vlm_fixtures.write_jpeg_parquet:
a `messages` column and an `images` column of datasets.Image holding JPEG bytes, 600x600 noise at
quality 95, about 425 KB each, one or two a row) until it holds --megabytes of images. The measure runs in a child process that
loads the model folder and, once, the same path on a file of two such rows (what is loaded
and allocated once: imports, pyarrow's Parquet reader and pools, the image decoders), then resets
its peak resident set (VmHWM: the base) and reports it after the data set is loaded, and after
every block is read; and the largest peak of the encoding worker processes (--workers > 1). The
growth is the peak less the base, per MiB of images.

    nice python bench/vlm_parquet_memory.py [--megabytes 150] [--workers 1] [--out DIR] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MB = 1 << 20


def child(folder: Path, data: Path, workers: int) -> dict:
    """The measure, in this (child) process."""
    import dataclasses

    from hputrain.recipes import HFOptions
    from hputrain.kinds.vlm.recipe import load_vision
    from hputrain.kinds.vlm.run import load_image_rows

    def peak() -> float:
        """This process's peak resident set since the reset below (VmHWM), in MiB."""
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    _, processing = load_vision(folder)
    options = HFOptions(model=str(folder), dataset=str(data), dataset_num_proc=workers,
                        validation_split_percentage=0)
    with tempfile.TemporaryDirectory(prefix="vlm-parquet-warm-") as warm:  # the same path on two
        small = data.with_name("warm-up.parquet")  # rows: what is loaded and allocated once
        load_image_rows(dataclasses.replace(options, dataset=str(small)), processing, 128, warm)
    Path("/proc/self/clear_refs").write_text("5")  # the peak so far (imports, the model) set aside
    base = peak()
    with tempfile.TemporaryDirectory(prefix="vlm-parquet-cache-") as cache:
        loaded = load_image_rows(options, processing, 128, cache)
        after_load = peak()
        for i in range(len(loaded.train)):
            loaded.train[i]
        after_blocks = peak()
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"base_mib": base, "after_load_mib": after_load, "after_blocks_mib": after_blocks,
            "workers_peak_mib": children, "blocks": len(loaded.train), "images": loaded.stats.images}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=150.0)
    parser.add_argument("--workers", type=int, default=1, help="--dataset-num-proc")
    parser.add_argument("--out", type=Path, help="where the folder and the files go (default: a "
                        "temporary folder)")
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("--child", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.workers)))
        return 0
    sys.path.insert(0, str(ROOT))
    from tests.vlm_fixtures import tiny_vlm_folder, write_jpeg_parquet

    with tempfile.TemporaryDirectory(prefix="vlm-parquet-") as scratch:
        out = args.out or Path(scratch)
        out.mkdir(parents=True, exist_ok=True)
        folder = tiny_vlm_folder(out / "llava", "llava")
        data = out / "images.parquet"
        rows, image_bytes = write_jpeg_parquet(data, args.megabytes)
        write_jpeg_parquet(data.with_name("warm-up.parquet"), 0.5, seed=1)  # two rows
        run = subprocess.run([sys.executable, __file__, "--workers", str(args.workers), "--child",
                              str(folder), str(data)], capture_output=True, text=True, cwd=ROOT)
        if run.returncode:
            print(run.stderr, file=sys.stderr)
            return run.returncode
        result = json.loads(run.stdout.strip().splitlines()[-1])
        result["file_mib"] = round(data.stat().st_size / MB, 1)
    images = image_bytes / MB
    result.update(rows=rows, image_mib=round(images, 1), workers=args.workers)
    grown = result["after_blocks_mib"] - result["base_mib"]
    result["growth_mib_per_image_mib"] = round(grown / images, 3)
    print(f"{rows} rows, {images:.1f} MiB of images, --dataset-num-proc {args.workers}: peak RSS "
          f"{result['base_mib']:.0f} MiB before, {result['after_load_mib']:.0f} after loading, "
          f"{result['after_blocks_mib']:.0f} after reading every block; +{grown:.0f} MiB, "
          f"{result['growth_mib_per_image_mib']:.2f} MiB per MiB of images; encoding workers' "
          f"peak {result['workers_peak_mib']:.0f} MiB")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
