"""Attacks on finished runs and the cut-layer advisor: above the engine, which they drive; the
roles never import them (splitlab.privacy keeps what the roles use)."""
