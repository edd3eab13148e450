"""The torch-free contract the API, the engine and the client share: the job spec, the training options, the
dataset line format, the reward protocol's types, the REST API's response shapes (`api`) and the generated gRPC
code. Imports nothing of the project."""
