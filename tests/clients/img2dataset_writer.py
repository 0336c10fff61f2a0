"""img2dataset's webdataset writer (``WebDatasetSampleWriter``), vendored to write shards with
it through webdataset 1.0.2's and webds's ``TarWriter`` in tests/test_clients.py.

Origin: img2dataset 1.47.0 (the PyPI wheel), file ``img2dataset/writer.py``
(https://github.com/rom1504/img2dataset), class ``WebDatasetSampleWriter`` (lines 94-135).
SPDX-License-Identifier: MIT. Copyright (c) 2021 Romain Beaumont.

Permission is hereby granted, free of charge, to any person obtaining a copy of this software and
associated documentation files (the "Software"), to deal in the Software without restriction,
including without limitation the rights to use, copy, modify, merge, publish, distribute,
sublicense, and/or sell copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all copies or
substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING BUT
NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR PURPOSE AND
NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM,
DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE SOFTWARE.

What changed: only how the modules it uses are imported. ``make(wds, BufferedParquetWriter)``
takes the webdataset module to use (``webdataset`` or ``webds``) and the class that writes the
per-shard parquet of metadata: img2dataset's ``BufferedParquetWriter`` needs pyarrow, which this
project does not install, and has nothing to do with webdataset, so the test passes a stand-in
with its constructor, ``write`` and ``close``. The class is indented one level inside ``make``.
"""

# ruff: noqa
import json
from types import SimpleNamespace

import fsspec
import numpy as np


def make(wds, BufferedParquetWriter):
    """img2dataset's WebDatasetSampleWriter over ``wds``."""

    class WebDatasetSampleWriter:
        """WebDatasetSampleWriter is a image+caption writer to webdataset"""

        def __init__(
            self,
            shard_id,
            output_folder,
            save_caption,
            oom_shard_count,
            schema,
            encode_format,
        ):
            self.oom_shard_count = oom_shard_count
            shard_name = "{shard_id:0{oom_shard_count}d}".format(  # pylint: disable=consider-using-f-string
                shard_id=shard_id, oom_shard_count=oom_shard_count
            )
            self.shard_id = shard_id
            fs, output_path = fsspec.core.url_to_fs(output_folder)
            self.tar_fd = fs.open(f"{output_path}/{shard_name}.tar", "wb")
            self.tarwriter = wds.TarWriter(self.tar_fd)
            self.save_caption = save_caption
            self.buffered_parquet_writer = BufferedParquetWriter(output_folder + "/" + shard_name + ".parquet", schema, 100)
            self.encode_format = encode_format

        def write(self, img_str, key, caption, meta):
            """write sample to tars"""
            if img_str is not None:
                sample = {"__key__": key, self.encode_format: img_str}
                if self.save_caption:
                    sample["txt"] = str(caption) if caption is not None else ""
                # some meta data may not be JSON serializable
                for k, v in meta.items():
                    if isinstance(v, np.ndarray):
                        meta[k] = v.tolist()
                sample["json"] = json.dumps(meta, indent=4)
                self.tarwriter.write(sample)
            self.buffered_parquet_writer.write(meta)

        def close(self):
            self.buffered_parquet_writer.close()
            self.tarwriter.close()
            self.tar_fd.close()

    return SimpleNamespace(**{k: v for k, v in locals().items() if k != "wds"})
