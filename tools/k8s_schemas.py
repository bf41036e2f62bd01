"""Extract strict Kubernetes JSON schemas for kubeconform from a kubernetes-validate wheel.

    python tools/k8s_schemas.py WHEEL OUT_DIR v1.30.0 [v1.37.0 ...]

writes OUT_DIR/<version>-strict/<kind>-<group>-<version>.json (kubeconform's file naming)
plus _definitions.json beside them. The wheel's schemas refer to their shared definitions
as "/api/_definitions.json#..." under an "https://kubernetes.io/..." $id, which would make
kubeconform go to the network; here each $id is dropped and each such $ref made relative
("_definitions.json#..."), so every reference resolves to the file next to it. Nothing
else changes: "additionalProperties": false (strict) is kept throughout.
Standard library only (run by tools/install-deploy-tools.sh before any venv exists).
"""

from __future__ import annotations

import json
import shutil
import sys
import zipfile
from pathlib import Path

PREFIX = "kubernetes_validate/kubernetes-json-schema/"


def extract(wheel: Path, out: Path, versions: list[str]) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        for version in versions:
            src = f"{PREFIX}{version}-local-strict/"
            members = [n for n in names if n.startswith(src) and n.endswith(".json")]
            if not members:
                have = sorted(
                    {n[len(PREFIX) :].split("/")[0] for n in names if n.startswith(PREFIX)}
                )
                sys.exit(f"k8s_schemas: {wheel.name} has no {version} schemas (has: {have})")
            dest = out / f"{version}-strict"
            tmp = out / f".{version}-strict.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for name in members:
                doc = json.loads(z.read(name))
                doc.pop("$id", None)
                text = json.dumps(doc, separators=(",", ":"))
                text = text.replace('"/api/_definitions.json#', '"_definitions.json#')
                (tmp / name[len(src) :]).write_text(text)
            shutil.rmtree(dest, ignore_errors=True)
            tmp.rename(dest)
            print(f"k8s_schemas: {len(members)} schemas for {version} in {dest}")


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    extract(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
