"""The websocket hub and its HTTP API: connections, the protocol, tokens, fan-out of group events, the
chat backend's service API, bot protection. Imports the money core and the store; never the tools."""
