"""Ray Serve deployment of the fusion service: one deployment per expert, each replica an Expert
gRPC server; a coordinator deployment serving the Fusion gRPC service; a small registry through
which the coordinator finds the expert replicas. Built by `fusion.deploy.app:build_app` from the same YAML
config as the local build."""
