"""The fleet: warmed JIT caches carried between hosts.

Every JIT cache a unit's environment pins (FlashInfer's, Triton's, inductor's,
TVM-FFI's, DeepGEMM's) packed into archives, checked against the identity of the
host that built them, and moved through an OCI registry by digest
(docs/fleet.md). Nothing here builds a cache: ``supervisor.flashinfer`` does.

- ``archive``: what every archive shares: tar safety, file entries, atomic swaps,
  strict manifests and their one error message;
- ``bundle``: FlashInfer's cache as one archive (export, check, import);
- ``cache_layers``: the other caches as layers, with their identities;
- ``registry``: the OCI distribution API, checked by digest;
- ``distribute``: push and pull of a unit's caches as one artifact.
"""
