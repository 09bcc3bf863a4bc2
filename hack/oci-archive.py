#!/usr/bin/env python3
"""Writes an OCI image archive from root-filesystem directories, without a
container daemon (hack/image.sh calls it).

The archive is an OCI image layout (oci-layout, index.json, blobs/sha256/…)
that also carries Docker's manifest.json, so the one file loads with
`docker load`, `kind load image-archive`, `ctr import` and `podman load`.
Everything is reproducible from the inputs: files sorted, owners root
(except paths given with --owner), times set to --created, gzip without a
name or time.

  oci-archive.py --out FILE --ref REPO:TAG --created EPOCH \
      --config CONFIG.json --layer DIR [--layer DIR …] [--owner PATH=UID:GID …]

CONFIG.json holds the image config's `config` object (Entrypoint, User, Env,
Labels, …); the labels are copied to the manifest's annotations too.
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import stat
import sys
import tarfile
import time

MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"


def layer_tar(root, mtime, owners):
    """The uncompressed tar of `root`, reproducibly."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        paths = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(dirnames + filenames):
                paths.append(os.path.join(dirpath, name))
        for path in sorted(paths, key=lambda p: os.path.relpath(p, root)):
            rel = os.path.relpath(path, root)
            info = tar.gettarinfo(path, arcname=rel)
            uid, gid = owners.get("/" + rel, (0, 0))
            info.uid, info.gid, info.uname, info.gname = uid, gid, "", ""
            info.mtime = mtime
            info.pax_headers = {}
            if info.isreg():
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    return buf.getvalue()


def gz(data):
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=6) as g:
        g.write(data)
    return out.getvalue()


def sha(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--ref", required=True, help="repository:tag")
    p.add_argument("--created", type=int, required=True, help="seconds since the epoch")
    p.add_argument("--config", required=True)
    p.add_argument("--layer", action="append", required=True)
    p.add_argument("--owner", action="append", default=[], help="/path=UID:GID")
    a = p.parse_args()

    repo, _, tag = a.ref.rpartition(":")
    if not repo or "/" in tag:
        sys.exit(f"--ref must be repository:tag, not {a.ref}")
    owners = {}
    for o in a.owner:
        path, _, ids = o.partition("=")
        uid, _, gid = ids.partition(":")
        owners[path] = (int(uid), int(gid))
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(a.created))
    with open(a.config) as f:
        cfg = json.load(f)

    blobs = {}
    layers, diff_ids, history = [], [], []
    for d in a.layer:
        raw = layer_tar(d, a.created, owners)
        data = gz(raw)
        blobs[sha(data)] = data
        layers.append({"mediaType": MEDIA_LAYER, "digest": sha(data), "size": len(data)})
        diff_ids.append(sha(raw))
        history.append({"created": created, "created_by": f"hack/image.sh: {os.path.basename(os.path.normpath(d))}"})
    config = {
        "created": created,
        "architecture": "amd64",
        "os": "linux",
        "config": cfg,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": history,
    }
    config_bytes = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    blobs[sha(config_bytes)] = config_bytes
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": {"mediaType": MEDIA_CONFIG, "digest": sha(config_bytes), "size": len(config_bytes)},
        "layers": layers,
        "annotations": dict(cfg.get("Labels", {})),
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    blobs[sha(manifest_bytes)] = manifest_bytes
    index = {
        "schemaVersion": 2,
        "mediaType": MEDIA_INDEX,
        "manifests": [
            {
                "mediaType": MEDIA_MANIFEST,
                "digest": sha(manifest_bytes),
                "size": len(manifest_bytes),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {
                    # The OCI name is the tag; containerd and Docker read the
                    # full reference from this one.
                    "org.opencontainers.image.ref.name": tag,
                    "io.containerd.image.name": a.ref,
                },
            }
        ],
    }
    docker_manifest = [
        {
            "Config": "blobs/sha256/" + sha(config_bytes)[7:],
            "RepoTags": [a.ref],
            "Layers": ["blobs/sha256/" + l["digest"][7:] for l in layers],
        }
    ]
    files = [
        ("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode()),
        ("index.json", json.dumps(index, sort_keys=True, indent=1).encode()),
        ("manifest.json", json.dumps(docker_manifest, indent=1).encode()),
    ]
    files += [("blobs/sha256/" + d[7:], b) for d, b in sorted(blobs.items())]
    tmp = a.out + ".tmp"
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for dirname in ["blobs", "blobs/sha256"]:
            info = tarfile.TarInfo(dirname)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, a.created
            tar.addfile(info)
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, a.created
            tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, a.out)
    print(f"{a.out} {a.ref} {sha(manifest_bytes)}")


if __name__ == "__main__":
    main()
