"""A networked deployment: the server runs the engine, each client node runs in its own process.

- `protocol`: the protobuf envelope every message travels in, and the gRPC method;
- `certs`: a development CA, the server's certificate and one per client id (mutual TLS);
- `checks`: what the server checks in every message a client sends, before use;
- `audit`: the server's record of connections (OUT/connections.jsonl) and `revoked=FILE`;
- `server`: the network transport (verb calls down a stream per client) and `splitlab server`;
- `client`: `splitlab client`, a client node answering the server's calls;
- `launch`: `splitlab launch`, a server and its clients as processes on this machine.

See docs/deployment.md.
"""

import os

# gRPC's own log lines (handshake failures, ...) stay off stderr unless GRPC_VERBOSITY asks for them:
# what the server refuses, it says itself, in one line, and in OUT/connections.jsonl.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")
