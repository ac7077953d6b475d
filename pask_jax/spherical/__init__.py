"""Spherical KV (docs/SPHERICAL_KV.md): the tier cache state (:mod:`.cache`), the RDR
controller (:mod:`.rdr`), the runner (:mod:`.runner`), the harness methods — ablations and
hybrids as runner configurations (:mod:`.variants`) — and the bridge from PASK's policy and tags
for the hybrids (:mod:`.hybrid`)."""
