"""What the control plane and a node's agent agree on, and nothing else.

The node side (`agent`) and the control-plane apps (`mirror`, `catalog`, `fleet`,
`serving`, `gateway`, `launcher`) never import each other; both import this package.
It holds the queue and task names and their arguments (`tasks`), the format of the
progress keys in Redis (`progress`), and the two checks both sides must make the same
way: a plain file or node name (`names`) and a file's sha256 (`digest`); and the
credentials both sides derive from a node's token without sending them: task proofs
(`signing`), engine secrets and byte-listener passes (`credentials`).

Nothing here imports Django or a database: a node has neither.
"""
