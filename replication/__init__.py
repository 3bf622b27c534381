"""The replication protocol: commands, Twisted protocols, the master's server and the client."""
