"""Stream one S3 object to stdout: the downloader that webdataset's ``pipe:`` runs in the S3
workload (in place of ``aws s3 cp s3://BUCKET/KEY -``, which is not installed everywhere).

Usage: ``python benchmarks/s3cat.py ENDPOINT BUCKET KEY``; any key pair works with moto.
"""

from __future__ import annotations

import sys


def main() -> None:
    import boto3

    endpoint, bucket, key = sys.argv[1:4]
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="bench",
        aws_secret_access_key="bench",
    )
    body = client.get_object(Bucket=bucket, Key=key)["Body"]
    out = sys.stdout.buffer
    for chunk in body.iter_chunks(1 << 20):
        out.write(chunk)
    out.flush()


if __name__ == "__main__":
    main()
