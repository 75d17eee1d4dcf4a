"""The run's authorizer: admits nodes, places them on stages, issues short-lived credentials.

A single HTTP service (FastAPI on uvicorn) per run [report 3.6.1]. Modules, one concept each:

    config       AuthorizerConfig: what one authorizer process needs; authorizer.json (kept address)
    main         run_authorizer(config) and a small CLI; the readiness line
    accounts     the accounts command line: add, list, revoke account tokens
    app          the FastAPI app, body limit, rate-limit middleware, typed JSON errors
    routes       public /v1 endpoints (join, poll, renew, leave, run, revocations, evidence)
    admin        /v1/admin endpoints behind the admin bearer token (accounts, bans, live policy, evidence)
    models       server-side checks on the wire models (protocol.authorizer_api) and admin bodies
    service      Authorizer: the behaviour behind the routes
    evidence     reports of a worker's contradicted results: checked, recorded, the account banned
    policy       the live admission policy and its defaults
    admission    capability, integrity and account checks; RejectReason
    reachability dialing a joining node back over libp2p
    placement    which stage a worker serves
    queue        releasing the admission queue at the join rate; sweeping lapsed tickets
    ratelimit    who a join, poll, renewal or leave counts against, and whether it may go on (429)
    buckets      token buckets in tables of bounded size
    rejections   which rejected joins are stored as tickets; counts of the rest per source and minute
    store        participant records on SQLite or PostgreSQL, and every change to them
    reads        the store's queries (polls, counts, bans, revocations)
    statements   the hot-path SQL, built once per dialect
    schema       the tables and the invariants the database holds
    writer       group commit: durable writes without an fsync per request
    keys         the root key file and the admin token file
    issuer       signing credentials and revocation lists
    errors       the error tree
    testing      helpers for tests and benchmarks: a real PostgreSQL, an authorizer subprocess
"""
