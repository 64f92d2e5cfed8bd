"""Privacy at the cut: defenses at the client, attacks by a curious training server, a cut-layer advisor."""
