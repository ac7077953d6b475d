"""Spherical KV (docs/SPHERICAL_KV.md): the tier cache state (:mod:`.cache`) and the RDR
controller (:mod:`.rdr`)."""
