"""``webds pack-folder`` (an ImageFolder-style tree to shards) and the other converters."""

from __future__ import annotations

import argparse
from typing import Any

from .common import add_quiet, byte_size, positive_int, say, show_progress

EXAMPLE_PACK_FOLDER = """example:
  webds pack-folder photos/train -o shards/train-%06d.tar
  webds pack-folder imagenet/train -o s3://bucket/imagenet/train-%06d.tar --workers 32

DIR holds one subfolder per class (DIR/CLASS/.../IMAGE); classes are numbered in sorted order,
as torchvision's ImageFolder does, and the mapping is written as classes.json beside the shards.
Image files (.jpg .jpeg .png .ppm .bmp .pgm .tif .tiff .webp, any case) are stored byte for byte,
never decoded, each with its class index as .cls, in a random order (--seed) over all classes.
Next to the shards goes the shard index (train-%06d.tar -> train.index.json). Shards appear only
when complete: after an interruption, the same command writes only the missing ones. Hidden
folders and files (.ipynb_checkpoints, ...) are skipped.
Read back with: WebDataset("shards/train.index.json").decode("pil").to_tuple("jpg;png", "cls")"""


def register(subparsers: Any) -> None:
    """Add the converter subcommands."""
    _register_pack_folder(subparsers)
    _register_imagenet(subparsers)


def _workers(text: str) -> int:
    """argparse type: an int >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"expected a number of processes (0: write in this process), got {text!r}"
        )
    return value


def _add_shard_size(p: argparse.ArgumentParser) -> None:
    """``--maxcount`` and ``--maxsize``, as both converters take them."""
    p.add_argument(
        "--maxcount",
        type=positive_int,
        default=10000,
        help="at most this many samples per shard (default 10000)",
    )
    p.add_argument(
        "--maxsize",
        type=byte_size,
        default=3 * 10**9,
        help="aim for shards of at most this many bytes, e.g. 1G (default 3G)",
    )


def _add_seed(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="seed of the random order (default 0)")


def _register_pack_folder(subparsers: Any) -> None:
    from . import add_command

    p = add_command(
        subparsers,
        "pack-folder",
        help="pack an image folder (one subfolder per class) into shards",
        description="Pack an ImageFolder-style tree into shards, in parallel: each image file\n"
        "unchanged with its class index, classes.json and a shard index beside the shards.",
        epilog=EXAMPLE_PACK_FOLDER,
        run=run_pack_folder,
    )
    p.add_argument("directory", metavar="DIR", help="the folder of class subfolders")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="PATTERN",
        help="shard names with a %%-field for the shard number: a path or URL such as "
        "out/train-%%06d.tar or s3://bucket/train-%%06d.tar",
    )
    _add_shard_size(p)
    p.add_argument(
        "-w",
        "--workers",
        type=_workers,
        default=None,
        help="processes writing shards (default: one per CPU; 0: in this process)",
    )
    p.add_argument(
        "--no-shuffle",
        dest="shuffle",
        action="store_false",
        help="keep the folder order (class by class) instead of a random order",
    )
    _add_seed(p)
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="write every shard again, also those already there",
    )
    add_quiet(p)


def run_pack_folder(args: argparse.Namespace) -> int:
    from ..convert.folders import ImageFolderFiles, write_classes
    from ..convert.packing import pack

    dataset = ImageFolderFiles(args.directory)
    index = pack(
        dataset,
        args.output,
        maxcount=args.maxcount,
        maxsize=args.maxsize,
        workers=args.workers,
        shuffle=args.shuffle,
        seed=args.seed,
        overwrite=args.overwrite,
        progress=show_progress(args.quiet),
    )
    classes = write_classes(args.output, dataset.classes)
    say(
        args,
        f"packed {index.total} images of {len(dataset.classes)} classes into {len(index)} "
        f"shards; index {index.location}, classes {classes}",
    )
    return 0


EXAMPLE_IMAGENET = """example:
  webds imagenet ILSVRC2012_img_train.tar -o /data/in1k/train-%06d.tar \\
      --val ILSVRC2012_img_val.tar --val-labels LOC_val_solution.csv \\
      --val-output /data/in1k/val-%06d.tar --memory 8G
  curl -s https://host/ILSVRC2012_img_train.tar | webds imagenet - -o s3://bucket/in1k/train-%06d.tar

TRAIN_TAR (a path, URL, '-' or 'pipe:CMD') holds one tar per class (n01440764.tar ...) of JPEGs;
it is read once, as a stream. Samples are {key: n01440764_10026, jpg: the original bytes, cls:
the index of the synset in sorted order}; classes.json and the shard index go beside the shards.
The order is a uniform random permutation of all images (fixed by --seed), made in two passes:
each image goes to one of B temporary bucket files by a random key (B planned so a bucket holds
about 3/4 of --memory), then each bucket is loaded, sorted by key and written out.
Bounds: RAM about --memory (one bucket) + ~250 bytes per image in it + a few MiB; temporary
disk about the size of TRAIN_TAR (plus ~40 bytes per image), in --tmpdir (default: a hidden
folder in the output folder, or $TMPDIR for remote outputs), removed at the end, also after an
error or Ctrl-C. The same seed gives the same shards whatever --memory.
--val-labels is Kaggle's LOC_val_solution.csv, 'FILE LABEL' lines, or one LABEL per line in
sorted file-name order; a LABEL is a synset or a 0-based class index (the devkit's
ILSVRC2012_validation_ground_truth.txt needs its meta.mat, so it is refused). Validation shards
keep the tar's order. To convert the validation set later: webds imagenet --classes
/data/in1k/classes.json --val ... .
Exit status: 0 done; 1 a damaged or unexpected input (named with the class tar and member);
2 a bad argument or label file.
Read back: WebDataset("/data/in1k/train.index.json").decode("pil").to_tuple("jpg;png", "cls")"""


def _register_imagenet(subparsers: Any) -> None:
    from . import add_command

    p = add_command(
        subparsers,
        "imagenet",
        help="convert ImageNet's tar of class tars (and its validation tar) to shuffled shards",
        description="Convert ImageNet's training tar (one tar per class) into shards holding a\n"
        "uniform random permutation of all images, with bounded memory and temporary disk,\n"
        "and optionally its validation tar with a label file.",
        epilog=EXAMPLE_IMAGENET,
        run=run_imagenet,
    )
    p.add_argument(
        "train",
        nargs="?",
        metavar="TRAIN_TAR",
        help="the training tar: a path, a URL, '-' (stdin) or 'pipe:CMD'",
    )
    p.add_argument(
        "-o",
        "--output",
        metavar="PATTERN",
        help="training shard names with a %%-field for the shard number, e.g. "
        "out/train-%%06d.tar or s3://bucket/train-%%06d.tar",
    )
    p.add_argument("--val", metavar="VAL_TAR", help="the validation tar (flat, of JPEGs)")
    p.add_argument(
        "--val-labels",
        metavar="FILE",
        help="labels of the validation images (path or URL): LOC_val_solution.csv, "
        "'FILE LABEL' lines, or one LABEL per line in sorted file-name order",
    )
    p.add_argument(
        "--val-output",
        metavar="PATTERN",
        help="validation shard names (default: the -o pattern with 'train' in its file name "
        "replaced by 'val', e.g. out/val-%%06d.tar)",
    )
    p.add_argument(
        "--classes",
        metavar="FILE",
        help="classes.json of earlier training shards, to convert the validation set alone",
    )
    _add_shard_size(p)
    _add_seed(p)
    p.add_argument(
        "--memory",
        type=byte_size,
        default=2 * 10**9,
        help="RAM for one bucket of the shuffle, e.g. 8G (default 2G); peak use is about this "
        "plus ~250 bytes per image in a bucket",
    )
    p.add_argument(
        "--tmpdir",
        metavar="DIR",
        help="folder for the temporary buckets, which take about the size of TRAIN_TAR "
        "(default: a hidden folder in the output folder; $TMPDIR for remote outputs)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='also store {"synset": ...} as a json field in every sample',
    )
    add_quiet(p)


def run_imagenet(args: argparse.Namespace) -> int:
    from ..convert.imagenet import convert_imagenet
    from ..errors import ArgumentError

    if args.train is None and args.val is None:
        raise ArgumentError("give TRAIN_TAR, or --val with --classes to convert a validation set")
    if args.train is not None and args.output is None:
        raise ArgumentError("give the training shard pattern with -o, e.g. -o out/train-%06d.tar")
    summary = convert_imagenet(
        args.train,
        args.output,
        val_tar=args.val,
        val_labels=args.val_labels,
        val_pattern=args.val_output,
        classes=args.classes,
        maxcount=args.maxcount,
        maxsize=args.maxsize,
        seed=args.seed,
        memory=args.memory,
        tmpdir=args.tmpdir,
        with_json=args.json,
        progress=show_progress(args.quiet),
    )
    train, val = summary["train"], summary["val"]
    if train is not None:
        say(
            args,
            f"wrote {train['samples']} training images of {summary['classes']} classes into "
            f"{len(train['shards'])} shards ({train['buckets']} buckets, {train['splits']} "
            f"splits); index {train['index']}, classes {summary['classes_json']}",
        )
    if val is not None:
        say(
            args,
            f"wrote {val['samples']} validation images into {len(val['shards'])} shards; "
            f"index {val['index']}",
        )
    return 0
