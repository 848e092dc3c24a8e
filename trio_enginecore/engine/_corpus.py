"""Training text of the built-in ``ngram`` model (written for this project).

Paragraphs are separated by blank lines; the model learns to end a generation (emit
EOS) where a paragraph ends.
"""

CORPUS = """\
A nursery is a promise about time. Every task that starts inside it finishes before the \
block that opened it is allowed to end, so nothing runs behind your back and nothing is \
left over when the work is done.

When a request is cancelled, the engine should stop working on it at once. The client \
sends an abort, the scheduler removes the request from its queues, and the memory it held \
is given back to the requests that are still waiting for their turn.

The scheduler runs in steps. In each step it takes the requests that fit in the batch, \
asks the model for one new token for each of them, and sends the tokens back to the \
clients that asked. Requests that reach their length limit or produce a stop token are \
finished and leave the batch, and waiting requests take their place.

Good software is honest about failure. If the engine dies, every caller hears about it \
promptly and with a clear reason, instead of waiting forever for an answer that will \
never come.

The river ran quietly under the old stone bridge. In the morning the fishermen came down \
to the water with their nets, and in the evening the children sat on the wall and \
counted the boats that drifted back towards the harbour.

Tea is best made with water that has only just stopped boiling. Warm the pot first, let \
the leaves steep for three or four minutes, and pour it slowly into cups that are waiting \
on the table beside a plate of bread and butter.

A good test reads like a specification. It says what should happen, makes it happen with \
real parts where it can, and fails loudly with a message that tells the reader what went \
wrong and where to look next.

Messages travel between processes as frames. The first frame holds the encoded request, \
and large arrays follow in frames of their own, so that nobody has to copy them twice on \
the way from one side of the socket to the other.

The garden was full of bees in the late summer. The apple trees bent under their fruit, \
the beans climbed past the top of their poles, and the old cat slept in the shade of the \
rhubarb leaves until the sun went down.

Structured concurrency makes programs easier to read. You can look at a function and \
know which tasks it starts, when they end, and where their errors go, because the shape \
of the code is the shape of the program while it runs.
"""
