"""OpenAI's Files and Batches APIs (issue 42): bulk work as a job.

`parse` checks a batch's create body and each line of its input file, pure;
`output` writes the API's objects (a file, a batch, a result line, a list);
`endpoint` is the routes. The runner that sends the lines through the
synchronous endpoints is `runner` (through the shell's door, server/http/door.py); the rows are
the state database's (server/operations/state_db.py).
"""
