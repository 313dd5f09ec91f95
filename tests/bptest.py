"""Helpers shared by the test directories (imported as `bptest`; tests/ is on pythonpath)."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CRD = REPO / "crds" / "batchingpolicy.yaml"


@dataclass
class Kube:
    """A handle on the cluster under test: a kubeconfig plus a kubectl that uses it."""

    kubeconfig: Path
    kubectl_bin: str
    external: bool

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [self.kubectl_bin, f"--kubeconfig={self.kubeconfig}", *args],
            input=input, capture_output=True, text=True, check=False, timeout=60,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed:\n{result.stderr}")
        return result

    def apply(self, manifest: dict[str, Any] | str, *extra: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        text = manifest if isinstance(manifest, str) else yaml.safe_dump(manifest)
        return self.kubectl("apply", "-f", "-", *extra, input=text, check=check)

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        args = ["get", kind, name, "-o", "json"]
        if namespace:
            args += ["-n", namespace]
        result = self.kubectl(*args, check=False)
        if result.returncode != 0:
            if "NotFound" in result.stderr or "not found" in result.stderr:
                return None
            raise AssertionError(result.stderr)
        obj: dict[str, Any] = yaml.safe_load(result.stdout)
        return obj

    def wait_for(self, predicate: Any, timeout: float, what: str) -> Any:
        """Poll ``predicate`` until it returns something truthy (bounded by ``timeout``)."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = predicate()
            if last:
                return last
            time.sleep(0.3)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")
