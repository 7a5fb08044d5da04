"""Generated protobuf and gRPC stubs for envfleet.v1 (made by tools/gen_proto.py; never edit by hand)."""
