"""The runtime: one request's path through the processes, and who owns what on the way.

::

    server process                                         worker process (one per rank)
    ------------------------------------------------       -----------------------------------
    api/ (asyncio)   route: parse, admit, submit_async
        |  task deque; the posting thread makes the pass
    conductor pass   Conductor: the walk state machine       engine loop (main thread):
                     Batcher: which ready items leave,         inbox: reads its rank link,
                     to which rank                             decodes inputs, pulls held
                     pool.submit_batch / pool.regions ------>  values from their rank (peers)
                                   StartRegions, RunBatch     (watch thread: heartbeats)
                                                                RankScheduler: region runs (a
                                                                Conductor over region walks) and
                                                                simple loops (LoopStepper), every
                                                                ready item of every request
                                                                batched by node
                                                                NodeRunner: the batched call
        pool io thread: copy reports out, ack <--------------   reports: loop exits, committed
        |  then a conductor pass, same thread RegionEvents,      stream items, failures; outputs
    conductor pass: complete / streamed     BatchDone            as soon as they exist
        |  RequestHandle (asyncio wake-up)
    api/: SSE chunks, JSON answer                            rank to rank (peer sockets): a held
                                                             value pulled by its consumer rank

Who drives what (``lowering.regions``): a *region*, the items of a walk one rank holds wholly
(loops included), is handed to its rank once per request; the rank steps its iterations with
no process crossing and reports only at its exit (and each committed item of a client stream
or a stream into another region). Loops whose bodies span ranks the conductor drives node by
node, speculating one iteration of a dynamic loop ahead (``Conductor(speculate=)``).

Where values live (``ObjectRef``): a value stays on the rank that made it unless a client or the
conductor itself needs its bytes (``ExecutablePlan.conductor_values``); a consumer on another
rank pulls it from there (``peers`` on one host; across hosts one Mooncake read of the block
its producer exported, ``remote_data="mooncake"``), never through the server process, which
releases it (``Release``) when its last reader is done.

Modules, by role:

    server        serve(), Server: the Python API; conductorpass: what a conductor pass
                  does (ready items out to the ranks, replies and region events in, events
                  out to the handles); passes: who makes a pass, and when (a burst of
                  submissions in one); burst: a burst sent in chunks as it is admitted, held
                  by its rank until the last; handle: RequestHandle, what a caller holds of a
                  request
    conductor     the walk state machine (pure); framedriver (its frames: passes, node
                  items), loopdriver (its loops), loopmaps (a map's iterations as
                  items), regionitems (its region items: streams, feeds, credit),
                  workitem, walkspec, frames: its parts
    batcher       the batching rule of the conductor's node items (pure)
    pool          the worker processes and sockets; poollinks (a rank link to each spawned
                  rank: ranklink, one Unix socket in place of ZeroMQ's pair), poolio (the io
                  thread: reports read and dispatched by type, deaths seen at once),
                  poolranks (a rank's start handshake and its end), poolbatches (node
                  batches), poolregions, poolremote (remote ranks, link probes),
                  poolsupervision, poolstate, config
    supervisor    when a silent rank is hung, restarts of dead ranks, crash loops (pure)
    worker        a worker process: sockets, the watch thread; workerbuild: its setup
                  (model loaded, placed on its device: device); workerinbox: its
                  commands (rank link, or a remote rank's ZeroMQ socket) read by the engine's
                  thread; rankcommands: what they ask of the engine; engine: its engine
                  loop; heap: its heap frozen once set up (no full collection walks it again)
    rankscheduler what a rank runs next (pure); rankreports: its steps and reports;
                  regionwalk: regions as walks; loopstep: the fast path for simple loops
                  (pure); stepvalues: a cohort's streamed steps kept as one block; runner:
                  runs a batch of one node
    messages      every message on a socket (msgspec structs, never pickle); wirevalues:
                  how a value is written in one
    transport, shm, shmreader, tensorcodec, peers   how values move: inline, shared memory
                  (shm: segments and their owner; shmreader: the read side), rank to rank
    local         the same path in one process (tests, reference runs)
    kv/           the paged KV engine; net/ other hosts; tp/ tensor parallelism

A tensor-parallel group (``ExecutablePlan.tp_groups``) is N worker processes that joined one
``torch.distributed`` world before loading their shards: the conductor dispatches to its
leader alone, whose component calls are broadcast to the followers and run in lockstep
(``tp.member``); only the leader reports. Replicas are ranks of one node that the batcher
chooses between, a request's KV-carrying calls staying on the replica holding its cache.
"""
