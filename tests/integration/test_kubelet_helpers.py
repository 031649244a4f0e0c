"""The test kubelet's pure helpers: $(VAR) expansion, mountPath rewriting, label sanitizing."""

from __future__ import annotations

from batchknee.devcluster.kubelet import expand, rewrite_paths, sanitize_label


def test_expand_follows_kubernetes_rules() -> None:
    env = {"A": "1", "B": "two"}
    assert expand("--x=$(A)-$(B)", env) == "--x=1-two"
    assert expand("$(MISSING)", env) == "$(MISSING)"
    assert expand("$$(A)", env) == "$(A)"


def test_rewrite_paths_maps_mounts_and_flag_values() -> None:
    mounts = [("/etc/batchknee/sub", "/h/sub"), ("/etc/batchknee", "/h/cfg")]
    assert rewrite_paths("/etc/batchknee/engine.yaml", mounts) == "/h/cfg/engine.yaml"
    assert rewrite_paths("/etc/batchknee/sub/x", mounts) == "/h/sub/x"
    assert rewrite_paths("--extra=/etc/batchknee/e.yaml", mounts) == "--extra=/h/cfg/e.yaml"
    assert rewrite_paths("/etc/batchknee", mounts) == "/h/cfg"
    assert rewrite_paths("/etc/batchkneeX/y", mounts) == "/etc/batchkneeX/y"
    assert rewrite_paths("--max-num-seqs=64", mounts) == "--max-num-seqs=64"


def test_sanitize_label() -> None:
    assert sanitize_label("app.kubernetes.io/name") == "app_kubernetes_io_name"
    assert sanitize_label("9lives") == "_9lives"
