"""Generated protobuf and gRPC stubs for envfleet.v1 (made by proto/generate.py; never edit by hand)."""
