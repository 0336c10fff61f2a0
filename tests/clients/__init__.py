"""Webdataset loader code of real clients (open_clip, timm, clip_benchmark, img2dataset),
vendored with their licences for tests/test_clients.py: each module's ``make(wds)`` runs
the client's own code over webdataset 1.0.2 or over webds."""
