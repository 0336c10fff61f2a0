"""timm's webdataset reader (``ReaderWds``), vendored to run it side by side with webdataset
1.0.2 and webds in tests/test_clients.py.

Origin: timm 1.0.31 (the PyPI wheel), https://github.com/huggingface/pytorch-image-models:
``timm/data/readers/reader_wds.py`` (all of it), and what it imports from its package:
``timm/data/readers/shared_count.py`` (``SharedCount``), ``reader.py`` (``Reader``),
``targets.py`` (all of it), ``class_map.py`` (all of it), and ``IterableImageDataset`` from
``timm/data/dataset.py`` (the dataset timm's loader wraps a reader in).
SPDX-License-Identifier: Apache-2.0. Copyright 2019 Ross Wightman (reader_wds.py: "Hacked
together by / Copyright 2022 Ross Wightman"). Licensed under the Apache License, Version 2.0;
you may not use this file except in compliance with the License. You may obtain a copy of the
License at http://www.apache.org/licenses/LICENSE-2.0. Unless required by applicable law or
agreed to in writing, software distributed under the License is distributed on an "AS IS" BASIS,
WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.

Modified (as the Apache License asks us to say) only in how modules are imported: the files are
concatenated; reader_wds.py's code is indented one level inside ``make(wds)``, which takes the
webdataset module to use (``webdataset`` or ``webds``), and its
``try: import webdataset as wds ... except ImportError`` block became attribute lookups on
``wds``; its relative imports became the definitions above ``make``; ``yaml`` (needed only for
a non-JSON info file) is imported when present. ``IterableImageDataset.__init__``'s
``create_reader`` branch is never taken here (the test passes a reader object), and
``create_reader`` is not vendored.
"""

# ruff: noqa
import io
import json
import logging
import math
import numbers
import os
import pickle
import random
import sys
from abc import abstractmethod
from dataclasses import dataclass
from functools import partial
from itertools import islice
from multiprocessing import Value
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.utils.data as data
from PIL import Image
from torch.utils.data import Dataset, IterableDataset, get_worker_info

try:
    import yaml
except ImportError:
    yaml = None

# -- timm/data/readers/shared_count.py
class SharedCount:
    def __init__(self, epoch: int = 0):
        self.shared_epoch = Value('i', epoch)

    @property
    def value(self):
        return self.shared_epoch.value

    @value.setter
    def value(self, epoch):
        self.shared_epoch.value = epoch


# -- timm/data/readers/reader.py
class Reader:
    def __init__(self):
        pass

    @abstractmethod
    def _filename(self, index, basename=False, absolute=False):
        pass

    def filename(self, index, basename=False, absolute=False):
        return self._filename(index, basename=basename, absolute=absolute)

    def filenames(self, basename=False, absolute=False):
        return [self._filename(index, basename=basename, absolute=absolute) for index in range(len(self))]



# -- timm/data/readers/targets.py
TARGET_FORMATS = ('indices', 'multihot')


def check_target_format(target_format: Optional[str], target_keys: Optional[Sequence[str]] = None) -> str:
    """Validate the target format of a single-key target ('indices' or 'multihot', None means 'indices').

    Multi-field (comma separated) target keys define their own format, so any explicit non-default
    format alongside them is a configuration error.
    """
    target_format = target_format or 'indices'
    if target_format not in TARGET_FORMATS:
        raise ValueError(f"Unknown target format '{target_format}', expected one of {TARGET_FORMATS}.")
    if target_keys and target_format != 'indices':
        raise ValueError(
            'Multi-field target keys define their own target format, leave the target format at its default.')
    return target_format


def _unwrap_sequence(value, part: str):
    """Descend through Sequence-style feature wrappers (HF datasets / TFDS) that have no key of their own."""
    while not (hasattr(value, '__contains__') and part in value) and hasattr(value, 'feature'):
        value = value.feature
    return value


def _contains(value, parts) -> bool:
    for i, part in enumerate(parts):
        if isinstance(value, (list, tuple)):
            # a list of dicts, the remaining path must exist in every item
            return all(_contains(item, parts[i:]) for item in value)
        value = _unwrap_sequence(value, part)
        if not hasattr(value, '__contains__') or part not in value:
            return False
        value = value[part]
    return True


def _resolve(value, parts):
    for i, part in enumerate(parts):
        if isinstance(value, (list, tuple)):
            # a list of dicts, map the remaining path over the items
            return [_resolve(item, parts[i:]) for item in value]
        value = _unwrap_sequence(value, part)[part]
    return value


def has_field(container, path: str) -> bool:
    """Whether a field name, or a '/' separated path into nested dict-like containers, exists."""
    if path in container:
        return True
    return _contains(container, path.split('/'))


def get_field(container, path: str):
    """Look up a field by name, or by a '/' separated path into nested dict-like containers.

    A literal key containing '/' (TFDS has top-level names such as 'image/filename') takes precedence.
    Feature schemas are walked through Sequence / List wrappers, so 'objects/category' resolves the
    ClassLabel inside a sequence of dicts. In samples the same path yields the list of values whether
    the sequence is stored as a dict of lists (HF Sequence, TFDS) or a list of dicts (HF List, JSON).
    """
    if path in container:
        return container[path]
    return _resolve(container, path.split('/'))


def parse_target_keys(target_key: Optional[str]) -> Optional[Tuple[str, ...]]:
    """Split a comma separated target key into the names of multiple binary target fields.

    Returns None for a single key (or no key) so callers keep their scalar target path.
    """
    if not target_key or ',' not in target_key:
        return None
    keys = tuple(key.strip() for key in target_key.split(','))
    if not all(keys) or len(set(keys)) != len(keys):
        raise ValueError(f"Multi-field target key '{target_key}' must list unique, non-empty field names.")
    return keys


def multi_field_class_to_idx(keys: Sequence[str], features=None) -> Dict[str, int]:
    """Class index mapping for multi-field targets, one class per field in the order given.

    When the dataset's features are known, every field (or '/' path) must exist in them.
    """
    if features is not None:
        missing = [key for key in keys if not has_field(features, key)]
        if missing:
            raise ValueError(f'Target fields {missing} not found in dataset features {sorted(features.keys())}.')
    return {key: index for index, key in enumerate(keys)}


def multi_field_target(sample, keys: Sequence[str]) -> List[int]:
    """Indices of the binary target fields that are on (> 0) in sample, i.e. a multi-label index list."""
    return [index for index, key in enumerate(keys) if get_field(sample, key) > 0]


# -- timm/data/readers/class_map.py
class _ClassMapUnpickler(pickle.Unpickler):
    """Restricted unpickler for `.pkl` class map files.

    A class map is a plain ``{class_name: index}`` dict of built-in types, which never
    triggers ``find_class``. Disallowing all globals therefore blocks arbitrary code
    execution from a crafted class map file (CWE-502) without affecting valid files.
    """

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f'Global {module}.{name} is not permitted in a class map file.')


def _is_sequence(value) -> bool:
    if isinstance(value, (str, bytes)):
        return False
    return isinstance(value, (list, tuple)) or getattr(value, 'ndim', 0) > 0  # lists, tuples, numpy / torch arrays


def remap_labels(label, class_to_idx, source_names=None):
    """Map a label, or a sequence of labels, through class_to_idx.

    An integer label missing from class_to_idx is first converted to its source name when
    source_names (index -> name) is given, so name-keyed class maps work with datasets that
    store class indices.
    """
    if _is_sequence(label):
        return [remap_labels(value, class_to_idx, source_names) for value in label]
    if source_names and isinstance(label, numbers.Integral) and label not in class_to_idx:
        label = source_names[label]
    return class_to_idx[label]


def remap_dense_target(values, class_to_idx):
    """Reorder a dense (multi-hot) target by position through a source index -> class index map.

    Positions absent from the map are dropped. Vector positions carry no names, so the map
    must be keyed by integer source index.
    """
    if not all(isinstance(key, numbers.Integral) for key in class_to_idx):
        raise ValueError(
            'Dense (multihot) targets need a class map keyed by source class index, names are not available.')
    values = list(values)
    if max(class_to_idx) >= len(values):
        raise ValueError(
            f'Class map refers to source index {max(class_to_idx)} but the target has {len(values)} entries.')
    result = [0.] * (max(class_to_idx.values()) + 1)
    for source, index in class_to_idx.items():
        result[index] = float(values[source])
    return result


def remap_target(target, class_to_idx, source_names=None, dense=False):
    """Remap a target through a class map: scalars and index lists by value, dense targets by position."""
    if dense:
        return remap_dense_target(target, class_to_idx)
    return remap_labels(target, class_to_idx, source_names)


def load_class_map(map_or_filename, root=''):
    if isinstance(map_or_filename, dict):
        assert dict, 'class_map dict must be non-empty'
        return map_or_filename
    class_map_path = map_or_filename
    if not os.path.exists(class_map_path):
        class_map_path = os.path.join(root, class_map_path)
        assert os.path.exists(class_map_path), 'Cannot locate specified class map file (%s)' % map_or_filename
    class_map_ext = os.path.splitext(map_or_filename)[-1].lower()
    if class_map_ext == '.txt':
        with open(class_map_path, encoding='utf-8') as f:
            class_to_idx = {v.strip(): k for k, v in enumerate(f)}
    elif class_map_ext == '.pkl':
        with open(class_map_path, 'rb') as f:
            class_to_idx = _ClassMapUnpickler(f).load()
        if not isinstance(class_to_idx, dict):
            raise ValueError(f'Invalid class map file, expected a dict ({class_map_path}).')
    else:
        assert False, f'Unsupported class map file extension ({class_map_ext}).'
    return class_to_idx



# -- timm/data/dataset.py: IterableImageDataset
class IterableImageDataset(data.IterableDataset):

    def __init__(
            self,
            root,
            reader=None,
            split='train',
            class_map=None,
            is_training=False,
            batch_size=1,
            num_samples=None,
            seed=42,
            repeats=0,
            download=False,
            input_img_mode='RGB',
            input_key=None,
            target_key=None,
            transform=None,
            target_transform=None,
            max_steps=None,
            **kwargs,
    ):
        assert reader is not None
        if isinstance(reader, str):
            self.reader = create_reader(
                reader,
                root=root,
                split=split,
                class_map=class_map,
                is_training=is_training,
                batch_size=batch_size,
                num_samples=num_samples,
                seed=seed,
                repeats=repeats,
                download=download,
                input_img_mode=input_img_mode,
                input_key=input_key,
                target_key=target_key,
                max_steps=max_steps,
                **kwargs,
            )
        else:
            self.reader = reader
        self.transform = transform
        self.target_transform = target_transform

    def __iter__(self):
        for img, target in self.reader:
            if self.transform is not None:
                img = self.transform(img)
            if self.target_transform is not None:
                target = self.target_transform(target)
            yield img, target

    def __len__(self):
        if hasattr(self.reader, '__len__'):
            return len(self.reader)
        else:
            return 0

    def set_epoch(self, count):
        # TFDS and WDS need external epoch count for deterministic cross process shuffle
        if hasattr(self.reader, 'set_epoch'):
            self.reader.set_epoch(count)

    def set_loader_cfg(
            self,
            num_workers: Optional[int] = None,
    ):
        # TFDS and WDS readers need # workers for correct # samples estimate before loader processes created
        if hasattr(self.reader, 'set_loader_cfg'):
            self.reader.set_loader_cfg(num_workers=num_workers)

    def filename(self, index, basename=False, absolute=False):
        assert False, 'Filename lookup by index not supported, use filenames().'

    def filenames(self, basename=False, absolute=False):
        return self.reader.filenames(basename, absolute)


# -- timm/data/readers/reader_wds.py


def make(wds):
    """timm's reader_wds.py over ``wds``: a namespace of its functions and classes."""
    _shuffle, getfirst = wds.filters._shuffle, wds.filters.getfirst
    expand_urls = wds.shardlists.expand_urls
    base_plus_ext, url_opener, tar_file_expander, valid_sample = (
        wds.tariterators.base_plus_ext,
        wds.tariterators.url_opener,
        wds.tariterators.tar_file_expander,
        wds.tariterators.valid_sample,
    )

    _logger = logging.getLogger(__name__)

    SAMPLE_SHUFFLE_SIZE = int(os.environ.get('WDS_SHUFFLE_SIZE', 8192))
    SAMPLE_INITIAL_SIZE = int(os.environ.get('WDS_INITIAL_SIZE', 2048))


    def _load_info(root, names=('_info.json', 'info.json')):
        if isinstance(names, str):
            names = (names,)
        tried = []
        err_str = ''
        for n in names:
            full_path = os.path.join(root, n)
            try:
                tried.append(full_path)
                with wds.gopen(full_path) as f:
                    if n.endswith('.json'):
                        info_dict = json.load(f)
                    else:
                        info_dict = yaml.safe_load(f)
                return info_dict
            except Exception as e:
                err_str = str(e)

        _logger.warning(
            f'Dataset info file not found at {tried}. Error: {err_str}. '
            'Falling back to provided split and size arg.')
        return {}


    @dataclass
    class SplitInfo:
        num_samples: int
        filenames: Tuple[str]
        shard_lengths: Tuple[int] = ()
        alt_label: str = ''
        name: str = ''


    def _parse_split_info(split: str, info: Dict):
        def _info_convert(dict_info):
            return SplitInfo(
                num_samples=dict_info['num_samples'],
                filenames=tuple(dict_info['filenames']),
                shard_lengths=tuple(dict_info['shard_lengths']),
                alt_label=dict_info.get('alt_label', ''),
                name=dict_info['name'],
            )

        if 'tar' in split or '..' in split:
            # split in WDS string braceexpand format, sample count can be included with a | separator
            # ex: `dataset-split-{0000..9999}.tar|100000` for 9999 shards, covering 100,000 samples
            split = split.split('|')
            num_samples = 0
            split_name = ''
            if len(split) > 1:
                num_samples = int(split[1])
            split = split[0]
            if '::' not in split:
                split_parts = split.split('-', 3)
                split_idx = len(split_parts) - 1
                if split_idx and 'splits' in info and split_parts[split_idx] in info['splits']:
                    split_name = split_parts[split_idx]

            split_filenames = expand_urls(split)
            if split_name:
                split_info = info['splits'][split_name]
                if not num_samples:
                    _fc = {f: c for f, c in zip(split_info['filenames'], split_info['shard_lengths'])}
                    num_samples = sum(_fc[f] for f in split_filenames)
                    split_info['filenames'] = tuple(_fc.keys())
                    split_info['shard_lengths'] = tuple(_fc.values())
                    split_info['num_samples'] = num_samples
                split_info = _info_convert(split_info)
            else:
                split_info = SplitInfo(
                    name=split_name,
                    num_samples=num_samples,
                    filenames=split_filenames,
                )
        else:
            if 'splits' not in info or split not in info['splits']:
                raise RuntimeError(f"split {split} not found in info ({info.get('splits', {}).keys()})")
            split = split
            split_info = info['splits'][split]
            split_info = _info_convert(split_info)

        return split_info


    class WdsTargetKeyError(ValueError):
        """The configured target key cannot be resolved for a sample, a dataset / config error rather than transient."""


    def log_and_continue(exn):
        """Call in an exception handler to ignore exceptions, issue a warning, and continue."""
        _logger.warning(f'Handling webdataset error ({repr(exn)}). Ignoring.')
        # NOTE: try force an exit on errors that are clearly code / config and not transient
        if isinstance(exn, (TypeError, WdsTargetKeyError)):
            raise exn
        return True


    def _decode(
            sample,
            image_key='jpg',
            image_mode='RGB',
            target_key=None,
            alt_label='',
    ):
        """ Custom sample decode
        * decode and convert PIL Image
        * resolve the target: the .cls byte string as an int when no key is set, otherwise from the json sidecar,
          either the target_key (or the split's alt_label) field holding an int, or a list (class indices, or a
          multi-hot vector under the 'multihot' target format) passed through for the target transform,
          or a tuple of binary field names whose on (> 0) fields form the multi-label index list
        * pass through JSON byte string (if it exists) without parse
        """
        json_key = target_key or alt_label
        if json_key:
            # targets are encoded in json metadata, missing sidecar / key is a hard error (see log_and_continue)
            multi_field = isinstance(json_key, (tuple, list))
            keys = tuple(json_key) if multi_field else (json_key,)
            if 'json' not in sample:
                raise WdsTargetKeyError(
                    f"Target key(s) {list(keys)} require a json sidecar, sample '{sample.get('__key__')}' has none.")
            meta = json.loads(sample['json'])
            missing = [key for key in keys if not has_field(meta, key)]
            if missing:
                raise WdsTargetKeyError(
                    f"Target key(s) {missing} not found in the json sidecar of sample '{sample.get('__key__')}', "
                    f"available keys: {sorted(meta)}.")
            if multi_field:
                target = multi_field_target(meta, keys)
            else:
                target = get_field(meta, json_key)
                if isinstance(target, (list, tuple)):
                    target = list(target)  # index list or multi-hot vector, values left for the target transform
                else:
                    target = int(target)
                    if target < 0:
                        # skipped labels currently encoded as -1, may change to a null/None value
                        return None
        else:
            target = int(sample['cls'])

        # decode image
        img = getfirst(sample, image_key)
        with io.BytesIO(img) as b:
            img = Image.open(b)
            img.load()
        if image_mode:
            img = img.convert(image_mode)

        # json passed through in undecoded state
        decoded = dict(jpg=img, target=target, json=sample.get('json', None))
        return decoded


    def pytorch_worker_seed():
        """get dataloader worker seed from pytorch"""
        worker_info = get_worker_info()
        if worker_info is not None:
            # favour the seed already created for pytorch dataloader workers if it exists
            return worker_info.seed
        # fallback to wds rank based seed
        return wds.utils.pytorch_worker_seed()


    if wds is not None:
        # conditional to avoid mandatory wds import (via inheritance of wds.PipelineStage)

        class detshuffle2(wds.PipelineStage):
            def __init__(
                    self,
                    bufsize=1000,
                    initial=100,
                    seed=0,
                    epoch=-1,
            ):
                self.bufsize = bufsize
                self.initial = initial
                self.seed = seed
                self.epoch = epoch

            def run(self, src):
                if isinstance(self.epoch, SharedCount):
                    epoch = self.epoch.value
                else:
                    # NOTE: this is epoch tracking is problematic in a multiprocess (dataloader workers or train)
                    # situation as different workers may wrap at different times (or not at all).
                    self.epoch += 1
                    epoch = self.epoch

                if self.seed < 0:
                    seed = pytorch_worker_seed() + epoch
                else:
                    seed = self.seed + epoch
                # _logger.info(f'shuffle seed: {self.seed}, {seed}, epoch: {epoch}')  # FIXME temporary
                rng = random.Random(seed)
                return _shuffle(src, self.bufsize, self.initial, rng)

    else:
        detshuffle2 = None


    class ResampledShards2(IterableDataset):
        """An iterable dataset yielding a list of urls."""

        def __init__(
            self,
            urls,
            nshards=sys.maxsize,
            worker_seed=None,
            deterministic=True,
            epoch=-1,
        ):
            """Sample shards from the shard list with replacement.

            :param urls: a list of URLs as a Python list or brace notation string
            """
            super().__init__()
            urls = wds.shardlists.expand_urls(urls)
            self.urls = urls
            assert isinstance(self.urls[0], str)
            self.nshards = nshards
            self.rng = random.Random()
            self.worker_seed = pytorch_worker_seed if worker_seed is None else worker_seed
            self.deterministic = deterministic
            self.epoch = epoch

        def __iter__(self):
            """Return an iterator over the shards."""
            if isinstance(self.epoch, SharedCount):
                epoch = self.epoch.value
            else:
                # NOTE: this is epoch tracking is problematic in a multiprocess (dataloader workers or train)
                # situation as different workers may wrap at different times (or not at all).
                self.epoch += 1
                epoch = self.epoch

            if self.deterministic:
                # reset seed w/ epoch if deterministic, worker seed should be deterministic due to arg.seed
                self.rng = random.Random(self.worker_seed() + epoch)

            for _ in range(self.nshards):
                index = self.rng.randint(0, len(self.urls) - 1)
                yield dict(url=self.urls[index])


    class ReaderWds(Reader):
        def __init__(
                self,
                root: str,
                name: Optional[str] = None,
                split: str = 'train',
                is_training: bool = False,
                num_samples: Optional[int] = None,
                batch_size: int = 1,
                repeats: int = 0,
                seed: int = 42,
                class_map: Optional[dict] = None,
                input_key: str = 'jpg;png;webp',
                input_img_mode: str = 'RGB',
                target_key: Optional[str] = None,
                target_format: Optional[str] = None,
                target_img_mode: str = '',
                filename_key: str = 'filename',
                sample_shuffle_size: Optional[int] = None,
                sample_initial_size: Optional[int] = None,
        ):
            super().__init__()
            if wds is None:
                raise RuntimeError(
                    'Please install webdataset 0.2.x package `pip install git+https://github.com/webdataset/webdataset`.')
            self.root = root
            self.is_training = is_training
            self.batch_size = batch_size
            self.repeats = repeats
            self.common_seed = seed  # a seed that's fixed across all worker / distributed instances
            self.shard_shuffle_size = 500
            self.sample_shuffle_size = sample_shuffle_size or SAMPLE_SHUFFLE_SIZE
            self.sample_initial_size = sample_initial_size or SAMPLE_INITIAL_SIZE

            self.input_key = input_key
            self.input_img_mode = input_img_mode
            self.target_key = target_key  # None reads the .cls file, any key names a field of the json sidecar
            self.target_keys = parse_target_keys(target_key)  # comma separated keys select binary sidecar fields
            self.dense_target = check_target_format(target_format, self.target_keys) == 'multihot'
            self.filename_key = filename_key
            self.key_ext = '.JPEG'  # extension to add to key for original filenames (DS specific, default ImageNet)

            self.info = _load_info(self.root)
            self.split_info = _parse_split_info(split, self.info)
            if num_samples is not None:
                self.num_samples = num_samples
            else:
                self.num_samples = self.split_info.num_samples
            if is_training and not self.num_samples:
                raise RuntimeError(f'Invalid split definition, num_samples not specified in train mode.')
            self.remap_class = False
            source_classes = multi_field_class_to_idx(self.target_keys) if self.target_keys else {}
            self._source_names = {index: name for name, index in source_classes.items()}
            if class_map:
                self.class_to_idx = load_class_map(class_map)
                self.remap_class = True
            else:
                self.class_to_idx = source_classes

            # Distributed world state
            self.dist_rank = 0
            self.dist_num_replicas = 1
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                self.dist_rank = dist.get_rank()
                self.dist_num_replicas = dist.get_world_size()

            # Attributes that are updated in _lazy_init
            self.worker_info = None
            self.worker_id = 0
            self.worker_seed = seed  # seed unique to each worker instance
            self.num_workers = 1
            self.global_worker_id = 0
            self.global_num_workers = 1
            self.init_count = 0
            self.epoch_count = SharedCount()

            # DataPipeline is lazy init, the majority of WDS DataPipeline could be init here, BUT, shuffle seed
            # is not handled in manner where it can be deterministic for each worker AND initialized up front
            self.ds = None

        def set_epoch(self, count):
            self.epoch_count.value = count

        def set_loader_cfg(
                self,
                num_workers: Optional[int] = None,
        ):
            if self.ds is not None:
                return
            if num_workers is not None:
                self.num_workers = max(1, num_workers)  # zero loader workers still has the main process
                self.global_num_workers = self.dist_num_replicas * self.num_workers

        def _lazy_init(self):
            """ Lazily initialize worker (in worker processes)
            """
            if self.worker_info is None:
                worker_info = torch.utils.data.get_worker_info()
                if worker_info is not None:
                    self.worker_info = worker_info
                    self.worker_id = worker_info.id
                    self.worker_seed = worker_info.seed
                    self.num_workers = worker_info.num_workers
                self.global_num_workers = self.dist_num_replicas * self.num_workers
                self.global_worker_id = self.dist_rank * self.num_workers + self.worker_id

            # init data pipeline
            abs_shard_filenames = [os.path.join(self.root, f) for f in self.split_info.filenames]
            pipeline = [wds.SimpleShardList(abs_shard_filenames)]
            # at this point we have an iterator over all the shards
            if self.is_training:
                pipeline.extend([
                    detshuffle2(
                        self.shard_shuffle_size,
                        seed=self.common_seed,
                        epoch=self.epoch_count,
                    ),
                    self._split_by_node_and_worker,
                    # at this point, we have an iterator over the shards assigned to each worker
                    wds.tarfile_to_samples(handler=log_and_continue),
                    wds.shuffle(
                        bufsize=self.sample_shuffle_size,
                        initial=self.sample_initial_size,
                        rng=random.Random(self.worker_seed) # this is why we lazy-init whole DataPipeline
                    ),
                ])
            else:
                pipeline.extend([
                    self._split_by_node_and_worker,
                    # at this point, we have an iterator over the shards assigned to each worker
                    wds.tarfile_to_samples(handler=log_and_continue),
                ])
            pipeline.extend([
                wds.map(
                    partial(
                        _decode,
                        image_key=self.input_key,
                        image_mode=self.input_img_mode,
                        target_key=self.target_keys or self.target_key,
                        alt_label=self.split_info.alt_label,
                    ),
                    handler=log_and_continue,
                ),
                wds.rename(image=self.input_key, target='target')
            ])
            self.ds = wds.DataPipeline(*pipeline)

        def _split_by_node_and_worker(self, src):
            if self.global_num_workers > 1:
                for s in islice(src, self.global_worker_id, None, self.global_num_workers):
                    yield s
            else:
                for s in src:
                    yield s

        def _num_samples_per_worker(self):
            num_worker_samples = self.num_samples / max(self.global_num_workers, self.dist_num_replicas)
            if self.is_training or self.dist_num_replicas > 1:
                num_worker_samples = math.ceil(num_worker_samples)
            if self.is_training:
                num_worker_samples = math.ceil(num_worker_samples / self.batch_size) * self.batch_size
            return int(num_worker_samples)

        def __iter__(self):
            if self.ds is None:
                self._lazy_init()

            num_worker_samples = self._num_samples_per_worker()
            if self.is_training or self.dist_num_replicas > 1:
                # NOTE: doing distributed validation w/ WDS is messy, hard to meet constraints that
                # same # of batches needed across all replicas w/ seeing each sample once.
                # with_epoch() is simple but could miss a shard's worth of samples in some workers,
                # and duplicate in others. Best to keep num DL workers low and a divisor of #val shards.
                ds = self.ds.with_epoch(num_worker_samples)
            else:
                ds = self.ds

            i = 0
            # _logger.info(f'start {i}, {self.worker_id}')  # FIXME temporary debug
            for sample in ds:
                target = sample['target']
                if self.remap_class:
                    target = remap_target(target, self.class_to_idx, self._source_names, dense=self.dense_target)
                yield sample['image'], target
                i += 1
            # _logger.info(f'end {i}, {self.worker_id}')  # FIXME temporary debug

        def __len__(self):
            num_samples = self._num_samples_per_worker() * self.num_workers
            return num_samples

        def _filename(self, index, basename=False, absolute=False):
            assert False, "Not supported"  # no random access to examples

        def filenames(self, basename=False, absolute=False):
            """ Return all filenames in dataset, overrides base"""
            if self.ds is None:
                self._lazy_init()

            names = []
            for sample in self.ds:
                if self.filename_key in sample:
                    name = sample[self.filename_key]
                elif '__key__' in sample:
                    name = sample['__key__'] + self.key_ext
                else:
                    assert False, "No supported name field present"
                names.append(name)
                if len(names) >= self.num_samples:
                    break  # safety for ds.repeat() case
            return names

    return SimpleNamespace(**{k: v for k, v in locals().items() if k != "wds"})
