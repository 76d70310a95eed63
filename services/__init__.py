"""gRPC servers and clients for the fusion service: expert server, coordinator, Python client."""
