"""Train an image classifier on ImageNet (or any image dataset) streamed from webds tar shards.

This is the classic PyTorch ImageNet example (pytorch/examples, ``imagenet/main.py``) with its
``ImageFolder`` + ``DistributedSampler`` data path replaced by shards read with webds: a shuffling,
decoding, augmenting ``webds.WebDataset`` pipeline feeding a ``webds.WebLoader``. Everything else
is as there: any ``torchvision.models`` architecture, SGD with momentum and weight decay, the
learning rate divided by 10 every 30 epochs, top-1/top-5 validation after each epoch, mixed
precision on GPUs, DistributedDataParallel under ``torchrun``, checkpoints.

Convert the data once. ImageNet's training tar (one tar per class inside) becomes fully shuffled
shards, with a shard index (``train.index.json``) and ``classes.json`` beside them::

    webds imagenet ILSVRC2012_img_train.tar -o /data/imagenet/train-%06d.tar \\
        --val ILSVRC2012_img_val.tar --val-labels LOC_val_solution.csv \\
        --val-output /data/imagenet/val-%06d.tar

(any folder of class subfolders: ``webds pack-folder DIR -o /data/mine/train-%06d.tar``).

Train on one GPU (or on the CPU)::

    python examples/train_imagenet.py --train /data/imagenet/train.index.json \\
        --val /data/imagenet/val.index.json --arch resnet50 --batch-size 256 --workers 8 \\
        --checkpoint /ckpt/resnet50.pt

on 8 GPUs of one machine, or 4 machines of 8 (``--batch-size`` is per process)::

    torchrun --nproc_per_node 8 examples/train_imagenet.py --train ... --val ...
    torchrun --nnodes 4 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        --rdzv-id imagenet examples/train_imagenet.py --train ... --val ...

straight from object storage or a web server (shards are streamed, never copied to disk)::

    python examples/train_imagenet.py --train s3://bucket/imagenet/train.index.json \\
        --val s3://bucket/imagenet/val.index.json
    python examples/train_imagenet.py --train 'gs://bucket/imagenet/train-{000000..000146}.tar' ...
    python examples/train_imagenet.py --train https://host/imagenet/ ...   # a folder or prefix

and continue an interrupted run exactly where its checkpoint was taken, mid-epoch included::

    python examples/train_imagenet.py ... --checkpoint /ckpt/r50.pt --checkpoint-every 1000
    python examples/train_imagenet.py ... --checkpoint /ckpt/r50.pt --resume /ckpt/r50.pt

How the data is read:

- ``--train``/``--val`` take a shard index (``*.index.json``), a shard pattern
  (``train-{000000..000146}.tar``, ``train-*.tar``) or a folder/prefix ending in ``/``. When they
  are not an index, one is looked for beside the shards (``train.index.json``, ``index.json``,
  the only ``*.index.json`` in a folder). Give ``--storage-options JSON`` for fsspec (endpoint,
  credentials) where the environment does not already configure them.
- With an index every rank reads exactly as many batches per epoch (``balance="pad"``: a few
  samples are read twice when the total does not divide by the world size), ``len()`` is exact,
  and the loader's ``state_dict()`` resumes mid-epoch. Multi-process training needs an index for
  the training set (make one with ``webds index 'train-*.tar' -o train.index.json``).
- Validation counts every validation sample exactly once: each rank evaluates its share, the
  per-sample results are gathered and the samples read twice (padding) counted once.
- The random crops and flips of each sample are drawn from a generator seeded by
  ``(--seed, epoch, sample key)``, so they do not depend on worker processes and a resumed run
  sees exactly the images the uninterrupted run would have seen.
- ``--classes`` defaults to the size of ``classes.json`` beside the training shards, else 1000.
- ``--log-json PATH`` writes per-step losses and each batch's sample keys, and per-epoch
  results (``{rank}`` in PATH: one file per rank; else rank 0's only).

Checkpoints (written by rank 0, atomically) hold the model, optimizer, gradient scaler, learning
rate schedule, epoch, step and every rank's training loader ``state_dict()`` (gathered: each
rank has read other samples); a resumed epoch reads each of its samples not yet trained on
exactly once (those that sat in a shuffle buffer in another order). Resuming needs the same
data, ``--batch-size``, ``--workers``, ``--seed`` and world size (webds says what changed if not).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import sys
import time
from contextlib import nullcontext
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch import nn
from torchvision import transforms

import webds
from webds.io.urls import local_path, open_url
from webds.shards.index import default_index_name, is_index_url

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train a torchvision model on image shards read with webds.",
        epilog="example: torchrun --nproc_per_node 8 examples/train_imagenet.py "
        "--train /data/imagenet/train.index.json --val /data/imagenet/val.index.json",
    )
    p.add_argument("--train", required=True, help="training shards: index .json, pattern, folder/")
    p.add_argument("--val", help="validation shards: index .json, pattern, folder/")
    p.add_argument("--classes", type=int, help="number of classes (default: classes.json, 1000)")
    p.add_argument("--arch", default="resnet18", help="a torchvision.models name, or 'tiny'")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=256, help="per process (GPU)")
    p.add_argument("--workers", type=int, default=4, help="DataLoader workers per process")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", "--weight-decay", dest="wd", type=float, default=1e-4)
    p.add_argument("--lr-step", type=int, default=30, help="divide the lr by 10 every N epochs")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--shuffle-buffer", type=int, default=1000, help="samples (per worker)")
    p.add_argument("--print-freq", type=int, default=10)
    p.add_argument("--checkpoint", help="save here after every epoch (a local path)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="also every N steps")
    p.add_argument("--resume", help="continue from this checkpoint")
    p.add_argument("--evaluate", action="store_true", help="only validate, then exit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=0, help="stop (and checkpoint) at step N")
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, help="default: on with CUDA")
    p.add_argument("--device", help="default: cuda:LOCAL_RANK if CUDA is available, else cpu")
    p.add_argument("--storage-options", type=json.loads, default={}, help="fsspec options JSON")
    p.add_argument("--log-json", help="write steps and epoch results here ({rank} allowed)")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "image_size", "print_freq", "shuffle_buffer", "lr_step"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.workers < 0 or args.checkpoint_every < 0 or args.max_steps < 0:
        p.error("--workers, --checkpoint-every and --max-steps must not be negative")
    if args.checkpoint_every and not args.checkpoint:
        p.error("--checkpoint-every needs --checkpoint PATH")
    return args


def fail(message: str) -> None:
    """Stop with a one-line error (exit status 2), as argparse does for bad arguments."""
    print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


# -- finding the data ------------------------------------------------------------------------


def _folder(url: str) -> str:
    """The folder (with its trailing slash) that holds ``url``, or ``""`` for a bare name."""
    return url if url.endswith("/") else url[: url.rfind("/") + 1]


def _exists(url: str, options: Dict[str, Any]) -> bool:
    path = local_path(url)
    if path is not None:
        return os.path.isfile(path)
    try:
        with open_url(url, "rb", **options) as stream:
            stream.read(1)
        return True
    except (OSError, webds.WebdsError):
        return False


def find_index(spec: str, options: Dict[str, Any]) -> Optional[str]:
    """The shard index for ``spec``: itself if it is one, else one found beside the shards."""
    if is_index_url(spec):
        return spec
    if "::" in spec or spec.startswith("pipe:"):
        return None  # several specs, or a command: nothing to look beside
    folder = _folder(spec)
    candidates = []
    if not spec.endswith("/"):
        # ShardWriter names the index after the pattern's stem: train-%06d.tar -> train.index.json
        cuts = [i for i in (spec.find(c) for c in "%{*?[") if i >= 0]
        if cuts:
            stem = spec[: min(cuts)]
        else:  # one shard named: train-000000.tar
            stem = spec.split(".tar")[0].rstrip("0123456789")
        candidates.append(default_index_name(stem + "%d.tar"))
    candidates.append(folder + "index.json")
    found = [c for c in dict.fromkeys(candidates) if _exists(c, options)]
    if found:
        return found[0]
    if spec.endswith("/"):
        path = local_path(spec)
        if path is not None:
            names = sorted(glob.glob(os.path.join(glob.escape(path), "*.index.json")))
        else:
            import fsspec

            fs, root = fsspec.core.url_to_fs(spec, **options)
            names = [
                spec + p.rsplit("/", 1)[-1] for p in fs.glob(root.rstrip("/") + "/*.index.json")
            ]
        if len(names) == 1:
            return names[0]
        if len(names) > 1:
            fail(f"{spec} holds several shard indexes ({', '.join(names)}): pass the one to use")
    return None


def read_num_classes(url: str, options: Dict[str, Any]) -> Optional[int]:
    """The number of classes in ``classes.json`` at ``url``, or None when there is none.

    Takes what ``webds pack-folder`` / ``webds imagenet`` write (``{"classes": [names...],
    "class_to_idx": {...}}``), a plain list of names, or a mapping of name -> index.
    """
    if not _exists(url, options):
        return None
    with open_url(url, "rb", **options) as stream:
        doc = json.loads(stream.read().decode("utf-8"))
    if isinstance(doc, dict) and isinstance(doc.get("classes"), (list, dict)):
        doc = doc["classes"]
    if isinstance(doc, dict) and all(isinstance(v, int) for v in doc.values()) and doc:
        return max(len(doc), max(doc.values()) + 1)
    if isinstance(doc, (list, dict)) and doc:
        return len(doc)
    fail(f"{url}: expected a list of class names or a mapping of name -> index")
    return None


def dataset_source(spec: str, index: Optional[str]) -> Tuple[str, Dict[str, Any]]:
    """(urls, keyword arguments) for WebDataset: the index alone stands for all of its shards."""
    if index is None:
        return spec, {}
    if index == spec or spec.endswith("/"):
        return index, {"balance": "pad"}
    return spec, {"index": index, "balance": "pad"}


# -- data pipelines ---------------------------------------------------------------------------


class SeededTransform:
    """Apply a random torchvision transform to ``(image, label, key)`` samples with its random
    draws seeded by ``(seed, epoch, key)``: the same crops in any worker, on any rank, on resume.

    Set ``epoch`` before each epoch's ``iter(loader)``: workers get a copy when they start.
    """

    def __init__(self, transform: Callable[[Any], torch.Tensor], seed: int) -> None:
        self.transform = transform
        self.seed = seed
        self.epoch = 0

    def __call__(self, sample: Tuple[Any, Any, str]) -> Tuple[torch.Tensor, int, str]:
        image, label, key = sample
        digest = hashlib.blake2b(f"{self.seed}:{self.epoch}:{key}".encode(), digest_size=8)
        with torch.random.fork_rng(devices=[]):  # leave the process's own generator alone
            torch.manual_seed(int.from_bytes(digest.digest(), "little") >> 1)
            return self.transform(image), int(label), key


def make_train_loader(
    args: argparse.Namespace, index: Optional[str], augment: SeededTransform, pin: bool
) -> webds.WebLoader:
    urls, kw = dataset_source(args.train, index)
    dataset = (
        webds.WebDataset(
            urls, shardshuffle=True, seed=args.seed, storage_options=args.storage_options, **kw
        )
        .shuffle(args.shuffle_buffer)  # seeded by the WebDataset's seed and the epoch
        .decode("pil")  # RGB PIL images, whatever the JPEG's own mode
        .to_tuple("jpg;png;jpeg", "cls", "__key__")
        .map(augment)
    )
    return webds.WebLoader(
        dataset, batch_size=args.batch_size, num_workers=args.workers, pin_memory=pin
    )


def make_val_loader(args: argparse.Namespace, index: Optional[str], pin: bool) -> webds.WebLoader:
    urls, kw = dataset_source(args.val, index)
    size = args.image_size
    transform = transforms.Compose(
        [
            transforms.Resize(int(round(size / 0.875))),
            transforms.CenterCrop(size),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    dataset = (
        webds.WebDataset(urls, shardshuffle=False, storage_options=args.storage_options, **kw)
        .decode("pil")
        .to_tuple("jpg;png;jpeg", "cls", "__key__", "__url__")
        .map_tuple(transform, int)
    )
    return webds.WebLoader(
        dataset, batch_size=args.batch_size, num_workers=args.workers, pin_memory=pin
    )


# -- model ------------------------------------------------------------------------------------


class TinyNet(nn.Module):
    """A small CNN (``--arch tiny``) for smoke tests and CPU runs."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(32),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


def build_model(arch: str, num_classes: int) -> nn.Module:
    if arch == "tiny":
        return TinyNet(num_classes)
    names = torchvision.models.list_models(torchvision.models)  # classification models only
    if arch not in names:
        fail(f"unknown --arch {arch!r}; choose 'tiny' or one of: {', '.join(sorted(names))}")
    return torchvision.models.get_model(arch, weights=None, num_classes=num_classes)


def logits(output: Any) -> torch.Tensor:
    """The main output of models that return several in training (inception_v3, googlenet)."""
    return output if isinstance(output, torch.Tensor) else output[0]


# -- training ---------------------------------------------------------------------------------


class Run:
    """Everything a training run carries between steps: model, optimizer, data, counters."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if args.device:
            device = torch.device(args.device)
        else:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", local_rank)
        self.device = device
        if device.type == "cuda":
            torch.cuda.set_device(device)
            torch.backends.cudnn.benchmark = True
        if self.world > 1:
            backend = "nccl" if device.type == "cuda" else "gloo"
            extra = {"device_id": device} if device.type == "cuda" else {}
            dist.init_process_group(backend, **extra)
        self.amp = device.type == "cuda" if args.amp is None else args.amp
        # float16 needs loss scaling; bfloat16 (the CPU's autocast type) does not.
        self.amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.amp and device.type == "cuda")
        self.step = 0
        self.classes = 0
        self.best_acc1 = 0.0
        self.log: Dict[str, Any] = {"rank": self.rank, "world_size": self.world, "steps": []}
        self.log["epochs"] = []

    def say(self, message: str) -> None:
        if self.rank == 0:
            print(message, flush=True)

    def autocast(self) -> Any:
        if not self.amp:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def all_reduce(self, values: List[float]) -> List[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def write_log(self) -> None:
        path = self.args.log_json
        if not path or ("{rank}" not in path and self.rank != 0):
            return
        path = path.replace("{rank}", str(self.rank))
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.log, f)
        os.replace(tmp, path)


def save_checkpoint(
    run: Run, model: nn.Module, optimizer: Any, scheduler: Any, loader: Any
) -> None:
    """Write the checkpoint (rank 0 only) to a temporary file, then rename it into place, so a
    crash never leaves a half-written checkpoint behind."""
    # Each rank has read other samples: gather every rank's loader state (a collective, so
    # every rank calls this), and rank 0 saves them all.
    states = loader.state_dict(all_ranks=True)
    if run.rank != 0:
        return
    state = states[0]
    path = run.args.checkpoint
    checkpoint = {
        "arch": run.args.arch,
        "classes": run.classes,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": run.scaler.state_dict(),
        "scheduler": scheduler.state_dict(),
        "epoch": state["epoch"],
        "step": run.step,
        "best_acc1": run.best_acc1,
        "loader": states,
        "args": vars(run.args),
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(checkpoint, tmp)
    os.replace(tmp, path)
    run.say(f"saved checkpoint {path} (epoch {state['epoch']}, step {run.step})")


def train_one_epoch(
    run: Run,
    epoch: int,
    ddp_model: nn.Module,
    model: nn.Module,
    criterion: nn.Module,
    optimizer: Any,
    scheduler: Any,
    loader: webds.WebLoader,
) -> bool:
    """Train over the rest of this epoch's batches; return True if --max-steps stopped it."""
    args = run.args
    ddp_model.train()
    try:
        total: Optional[int] = len(loader)
    except TypeError:  # no shard index: the epoch's length is unknown
        total = None
    first = loader.state_dict()["items"]  # > 0 when resuming mid-epoch
    sums = torch.zeros(3, dtype=torch.float64, device=run.device)  # loss, correct, samples
    batches, start, stopped = 0, time.perf_counter(), False
    tick, seen = start, 0
    for i, (images, labels, keys) in enumerate(loader, start=first):
        images = images.to(run.device, non_blocking=True)
        labels = labels.to(run.device, non_blocking=True)
        with run.autocast():
            output = logits(ddp_model(images))
            loss = criterion(output, labels)
        optimizer.zero_grad(set_to_none=True)
        run.scaler.scale(loss).backward()
        run.scaler.step(optimizer)
        run.scaler.update()
        run.step += 1
        batches += 1
        n = labels.numel()
        seen += n
        with torch.no_grad():
            correct = (output.argmax(1) == labels).sum()
            sums += torch.stack([loss.detach().double() * n, correct.double(), sums.new_tensor(n)])
        if args.log_json:
            run.log["steps"].append(
                {"epoch": epoch, "batch": i, "step": run.step, "loss": loss.item(), "keys": keys}
            )
        if run.step % args.print_freq == 0:
            now = time.perf_counter()
            rate = seen * run.world / max(now - tick, 1e-9)
            tick, seen = now, 0
            run.say(
                f"Epoch [{epoch}] step [{i + 1}/{total or '?'}]  loss {loss.item():.4f}  "
                f"lr {optimizer.param_groups[0]['lr']:.4g}  {rate:.1f} img/s"
            )
        if args.checkpoint_every and run.step % args.checkpoint_every == 0:
            save_checkpoint(run, model, optimizer, scheduler, loader)
        if args.max_steps and run.step >= args.max_steps:
            stopped = True
            break
    loss_sum, correct, count = run.all_reduce(sums.tolist())
    elapsed = time.perf_counter() - start
    result = {
        "epoch": epoch,
        "first_batch": first,
        "batches": batches,
        "samples": int(count),
        "train_loss": loss_sum / count if count else None,
        "train_acc1": 100.0 * correct / count if count else None,
    }
    run.log["epochs"].append(result)
    if count:
        run.say(
            f"Epoch [{epoch}] train loss {result['train_loss']:.4f}  acc@1 "
            f"{result['train_acc1']:.2f}  ({int(count)} samples, {batches} batches per rank, "
            f"{elapsed:.1f} s)"
        )
    if stopped and args.checkpoint:
        save_checkpoint(run, model, optimizer, scheduler, loader)
    return stopped


@torch.no_grad()
def validate(run: Run, model: nn.Module, loader: webds.WebLoader, classes: int) -> Dict[str, Any]:
    """Top-1/top-5 accuracy and loss over the validation set, each sample counted once.

    Ranks evaluate their shares (with an index, padded so every rank has as many); the
    per-sample results, keyed by (shard, key), are gathered and duplicates counted once.
    """
    model.eval()
    results: Dict[Tuple[str, str], Tuple[bool, bool, float]] = {}
    k, read = min(5, classes), 0
    for images, labels, keys, urls in loader:
        read += len(keys)
        images = images.to(run.device, non_blocking=True)
        labels = labels.to(run.device, non_blocking=True)
        with run.autocast():
            output = logits(model(images)).float()
        losses = F.cross_entropy(output, labels, reduction="none")
        top = output.topk(k, dim=1).indices
        top1 = (top[:, 0] == labels).tolist()
        topk = (top == labels[:, None]).any(dim=1).tolist()
        for item in zip(urls, keys, top1, topk, losses.tolist()):
            results.setdefault(item[:2], item[2:])
    if run.world > 1:
        gathered: List[Any] = [None] * run.world
        dist.all_gather_object(gathered, results)
        results = {}
        for part in gathered:
            for key, value in part.items():
                results.setdefault(key, value)
    n = len(results)
    values = list(results.values())
    return {
        "samples": n,
        "read": read,  # by this rank, padding included
        "acc1": 100.0 * sum(v[0] for v in values) / max(n, 1),
        "acc5": 100.0 * sum(v[1] for v in values) / max(n, 1),
        "loss": sum(v[2] for v in values) / max(n, 1),
    }


def report_val(run: Run, epoch: int, classes: int, loader: Any, model: nn.Module) -> None:
    start = time.perf_counter()
    val = validate(run, model, loader, classes)
    run.best_acc1 = max(run.best_acc1, val["acc1"])
    if run.log["epochs"] and run.log["epochs"][-1]["epoch"] == epoch:
        run.log["epochs"][-1]["val"] = val
    else:
        run.log["epochs"].append({"epoch": epoch, "val": val})
    run.say(
        f" * Epoch [{epoch}] val acc@1 {val['acc1']:.2f}  acc@{min(5, classes)} "
        f"{val['acc5']:.2f}  loss {val['loss']:.4f}  ({val['samples']} samples, "
        f"{time.perf_counter() - start:.1f} s)"
    )


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    run = Run(args)
    opts = args.storage_options
    train_index = find_index(args.train, opts)
    val_index = find_index(args.val, opts) if args.val else None
    if train_index is None and run.world > 1:
        fail(
            f"no shard index found for --train {args.train!r}: with {run.world} processes, "
            "every rank must read as many batches. Make one: webds index 'SHARDS' -o "
            "DIR/train.index.json, and pass it as --train"
        )
    if train_index is None:
        run.say(f"note: no shard index for {args.train!r}; the epoch length is unknown")
    classes = args.classes
    if classes is None:
        beside = _folder(train_index or args.train.split("::")[0]) + "classes.json"
        found = read_num_classes(beside, opts)
        classes = found or 1000
        run.say(f"classes: {classes} ({'from' if found else 'no'} {beside})")
    run.classes = classes

    torch.manual_seed(args.seed)
    model = build_model(args.arch, classes).to(run.device)
    criterion = nn.CrossEntropyLoss().to(run.device)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.wd
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.lr_step, gamma=0.1)

    pin = run.device.type == "cuda"
    size = args.image_size
    augment = SeededTransform(
        transforms.Compose(
            [
                transforms.RandomResizedCrop(size),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
            ]
        ),
        args.seed,
    )
    train_loader = make_train_loader(args, train_index, augment, pin)
    val_loader = make_val_loader(args, val_index, pin) if args.val else None

    start_epoch = 0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu", weights_only=True)
        if checkpoint["arch"] != args.arch or checkpoint["classes"] != classes:
            fail(
                f"{args.resume} holds a {checkpoint['arch']} with {checkpoint['classes']} "
                f"classes, not a {args.arch} with {classes}"
            )
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        if run.scaler.is_enabled() and checkpoint["scaler"]:
            run.scaler.load_state_dict(checkpoint["scaler"])
        if not args.evaluate:
            try:  # mid-epoch: each sample not yet trained on, once
                train_loader.load_state_dict(checkpoint["loader"])
            except webds.ArgumentError as exn:
                fail(
                    f"{args.resume}: {exn.message.split('. ')[0]}; use the same "
                    "data, --batch-size, --workers, --seed and number of processes as the run "
                    "that saved it"
                )
        saved = checkpoint["loader"][0]  # every rank's state: same epoch, as many batches
        start_epoch, run.step = saved["epoch"], checkpoint["step"]
        run.best_acc1 = checkpoint.get("best_acc1", 0.0)
        run.log["resumed"] = {"epoch": start_epoch, "batch": saved["items"]}
        run.say(
            f"resumed from {args.resume}: epoch {start_epoch}, batch {saved['items']}, "
            f"step {run.step}"
        )

    ddp_model: nn.Module = model
    if run.world > 1:
        ids = [run.device.index] if run.device.type == "cuda" else None
        ddp_model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    run.say(
        f"{args.arch}, {classes} classes, {run.world} process(es) on {run.device.type}"
        f"{', mixed precision' if run.amp else ''}; train {train_index or args.train}"
    )

    if args.evaluate:
        if val_loader is None:
            fail("--evaluate needs --val")
        report_val(run, start_epoch, classes, val_loader, model)
    else:
        for epoch in range(start_epoch, args.epochs):
            train_loader.set_epoch(epoch)  # keeps a resume position loaded for this epoch
            augment.epoch = epoch
            if train_one_epoch(
                run, epoch, ddp_model, model, criterion, optimizer, scheduler, train_loader
            ):
                run.log["stopped"] = {"epoch": epoch, "step": run.step}
                run.say(f"stopped at step {run.step} (--max-steps)")
                break
            scheduler.step()
            if val_loader is not None:
                report_val(run, epoch, classes, val_loader, model)
            if args.checkpoint:
                save_checkpoint(run, model, optimizer, scheduler, train_loader)
            run.write_log()
    run.write_log()
    if run.world > 1:
        dist.barrier()  # nobody tears down the group while a rank still gathers
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
