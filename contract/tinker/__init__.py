"""The Tinker API's wire shapes, shared by its door (service.tinker) and the primitives worker: the JSON request
bodies (`requests`) and the protobuf payloads as arrays (`arrays`)."""
