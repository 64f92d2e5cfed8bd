"""A networked deployment: the server runs the engine, each client node runs in its own process.

- `protocol`: the protobuf envelope every message travels in, and the gRPC method;
- `certs`: a development CA, the server's certificate and one per client id (mutual TLS);
- `checks`: what the server checks in every message a client sends, before use;
- `server`: the network transport (verb calls down a stream per client) and `splitlab server`;
- `client`: `splitlab client`, a client node answering the server's calls;
- `launch`: `splitlab launch`, a server and its clients as processes on this machine.

See docs/deployment.md.
"""
