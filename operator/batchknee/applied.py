"""Is a rendered object already in the cluster as rendered? Then a steady-state reconcile need not
apply it again (a no-op server-side apply still costs the apiserver a full decode, merge and
managed-fields pass: at a thousand LLMServings, three per object per interval).

Two checks, both needed:
- the content hash the last apply stamped on the object equals the hash of what is rendered now, so
  the set of fields the operator owns is the same (a field no longer rendered is removed only by an
  apply);
- every field rendered now has that value in the object read back (the apiserver only adds defaults
  around them), so nobody changed a field the operator manages since (a `kubectl edit` of the args is
  put back by the next reconcile, as a forced apply would).

Anything else (a value the apiserver writes in another form, a list someone extended) reads as
changed: the object is applied, as before — never skipped on a guess.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

APPLIED_ANNOTATION = "batchknee.io/applied-hash"
# On a Deployment (not in its pod template, whose every change rolls the pods): the hash of the pod
# template the last apply rendered, so a template field no longer rendered is seen as a change too.
TEMPLATE_ANNOTATION = "batchknee.io/template-hash"


def content_hash(obj: Mapping[str, Any]) -> str:
    """A short hash of the rendered object, without the stamp itself and the resourceVersion."""
    meta = {
        k: v for k, v in (obj.get("metadata") or {}).items() if k not in ("resourceVersion", "annotations")
    }
    annotations = {
        k: v
        for k, v in ((obj.get("metadata") or {}).get("annotations") or {}).items()
        if k != APPLIED_ANNOTATION
    }
    return _canonical_hash({**obj, "metadata": {**meta, "annotations": annotations}})


def _canonical_hash(value: Any) -> str:
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:20]


def _pod_template(obj: Mapping[str, Any]) -> Any:
    return (obj.get("spec") or {}).get("template")


def stamp(obj: dict[str, Any]) -> dict[str, Any]:
    """Put the content hash on the rendered object (in place), as an annotation of its own; on a
    workload, the pod template's hash too."""
    annotations = obj.setdefault("metadata", {}).setdefault("annotations", {})
    template = _pod_template(obj)
    if template is not None:
        annotations[TEMPLATE_ANNOTATION] = template_hash(obj)
    annotations[APPLIED_ANNOTATION] = content_hash(obj)
    return obj


def template_hash(rendered: Mapping[str, Any]) -> str:
    """The hash of a rendered workload's pod template (what `stamp` records on it)."""
    return _canonical_hash(_pod_template(rendered))


def recorded_template(existing: Mapping[str, Any]) -> str | None:
    """The pod template hash the last apply recorded on a workload read back."""
    value = ((existing.get("metadata") or {}).get("annotations") or {}).get(TEMPLATE_ANNOTATION)
    return value if isinstance(value, str) else None


def new_pod_template(rendered: Mapping[str, Any], existing: Mapping[str, Any] | None) -> bool:
    """Does the pod template rendered now differ from the one the last apply rendered, so that
    applying it rolls `existing`'s pods onto a new template (the spec's, the operator's own)? An
    edit of the object since is not (put back as rendered before), nor is creating it. Where no
    apply recorded its template (an operator before the hash): whether a field rendered now reads
    back otherwise."""
    if existing is None:
        return False
    recorded = recorded_template(existing)
    if recorded is not None:
        return recorded != template_hash(rendered)
    return not _holds(_pod_template(existing), _pod_template(rendered))


def _holds(have: Any, want: Any) -> bool:
    """Does `have` (read back) carry every field of `want` (rendered) with its value?"""
    if isinstance(want, Mapping):
        if not isinstance(have, Mapping):
            return False
        return all(_holds(have[key], value) if key in have else _empty(value) for key, value in want.items())
    if isinstance(want, list):
        if not isinstance(have, list):
            return False
        return len(have) == len(want) and all(_holds(h, w) for h, w in zip(have, want, strict=True))
    return type(have) is type(want) and bool(have == want)


def _empty(value: Any) -> bool:
    """Rendered as empty: the apiserver drops it (absent in the read-back is the same thing)."""
    return value is None or value == {} or value == []


def in_place(rendered: Mapping[str, Any], existing: Mapping[str, Any] | None) -> bool:
    """True when applying `rendered` (stamped) would change nothing in `existing`."""
    if existing is None:
        return False
    annotations = (existing.get("metadata") or {}).get("annotations") or {}
    wanted = ((rendered.get("metadata") or {}).get("annotations") or {}).get(APPLIED_ANNOTATION)
    if wanted is None or annotations.get(APPLIED_ANNOTATION) != wanted:
        return False
    body = {k: v for k, v in rendered.items() if k != "metadata"}
    meta = {k: v for k, v in (rendered.get("metadata") or {}).items() if k != "resourceVersion"}
    return _holds(existing, {**body, "metadata": meta})
