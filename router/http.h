/* http.h — routerd's HTTP front door: the OpenAI-compatible API, /health and /metrics
 * (DESIGN.md "HTTP front door"), on libmicrohttpd with JSON by jansson.
 *
 *   POST /v1/completions        prompt (a string, [one string], or [token ids])
 *   POST /v1/chat/completions   messages of system/user/assistant turns (the model's template)
 *        both: max_tokens (max_completion_tokens), temperature, top_p, top_k, seed, stop (a
 *        string or up to 8), n = 1, stream (server-sent events ending "data: [DONE]"),
 *        stream_options.include_usage, ignore_eos; usage in every answer; log-probabilities
 *        (completions: logprobs ≤ 5, the legacy arrays; chat: logprobs with top_logprobs ≤ 20,
 *        logprobs.content), those of the model's distribution (bd_sampler_logprobs)
 *   GET  /v1/models             the one model served
 *   GET  /health                200 {"status":"ok"} while serving, else 503 with the reason
 *   GET  /metrics               Prometheus text format (metrics.h)
 *
 * Errors come in OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 invalid
 * request, 404 unknown path or model, 405 wrong method, 413 body, prompt or context too long,
 * 429 queue full, 503 not serving, 500 an internal failure, 504 past its deadline.
 *
 * One thread per connection. A request is a serve.proto GenerateRequest sent by that thread on
 * a ZeroMQ DEALER socket of its own to an inproc:// endpoint the router's frontend also binds:
 * the event loop sees it as one more client, and no HTTP thread touches the loop's state.
 * While it waits, the thread watches its TCP connection: a client that closes it gets its
 * request cancelled (CancelRequest), which releases everything the request held.
 */
#ifndef BD_ROUTER_HTTP_H
#define BD_ROUTER_HTTP_H

struct bd_router;

/* Binds the frontend to the HTTP threads' inproc endpoint and starts listening on
 * rt->o.http ("HOST:PORT"; IPv4, [IPv6] or a name; port 0 picks a free one; "" starts
 * nothing). Call after the sockets and the model are set up, from the loop's thread. Logs
 * the URL. Returns 0, -EINVAL (a bad address), -EADDRINUSE or another -errno (logged). */
int bd_router_http_start(struct bd_router *rt);
/* Stops listening and waits for the connection threads (their requests get cancelled); call
 * before the ZeroMQ context is terminated. Nothing started is fine. */
void bd_router_http_stop(struct bd_router *rt);

#endif
