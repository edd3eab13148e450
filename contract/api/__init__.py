"""The REST API's response shapes: the service fills them, the client (client.sdk) reads them.

Pydantic only, so that the client installs without the server's dependencies. Request shapes stay
with the service (their validation reaches into the URL policy and the reward protocol), except the
job spec, which is contract.spec.
"""
