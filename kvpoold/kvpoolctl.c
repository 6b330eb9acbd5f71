/* kvpoolctl — kvpoold's operator CLI.
 *
 *   kvpoolctl [--endpoint E] [--config PATH | --no-config] [--timeout MS] COMMAND
 *     stats [--json] [--top N]   pool fill, bytes by format, largest holders, per device
 *     requests [--json]          every request record
 *     release REQUEST_ID         release one request (pages and slot)
 *     reclaim OWNER              release every request of a router session
 *
 * The endpoint comes from --endpoint, else [pool] endpoint of the config file, else the
 * default. Exit: 0, 1 on an error (reported on stderr), 2 on a usage error.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "base/bd_config.h"
#include "base/bd_ipc.h"
#include "base/bd_version.h"
#include "pool/bd_pool_client.h"

static void usage(FILE *f)
{
	fprintf(f, "usage: kvpoolctl [--endpoint E] [--config PATH | --no-config] [--timeout MS] "
		   "[--server-key FILE --secret-key FILE] COMMAND\n"
		   "  (CURVE: kvpoold's public key file, default $BDFP4_POOL_SERVER_KEY, and this\n"
		   "  client's secret key file, default $BDFP4_SECRET_KEY)\n"
		   "  stats [--json] [--top N]\n"
		   "  requests [--json]\n"
		   "  release REQUEST_ID\n"
		   "  reclaim OWNER\n");
}

static void human(char *buf, size_t len, uint64_t b)
{
	if (b >= (1ull << 30))
		snprintf(buf, len, "%.2f GiB", (double)b / (double)(1ull << 30));
	else if (b >= (1ull << 20))
		snprintf(buf, len, "%.2f MiB", (double)b / (double)(1ull << 20));
	else if (b >= 1024)
		snprintf(buf, len, "%.2f KiB", (double)b / 1024.0);
	else
		snprintf(buf, len, "%" PRIu64 " B", b);
}

static json_t *holder_json(const struct bd_pool_holder *h)
{
	return json_pack("{s:I, s:I, s:I, s:I, s:i}", "request_id", (json_int_t)h->request_id,
			 "owner", (json_int_t)h->owner, "pages", (json_int_t)h->pages, "reserved",
			 (json_int_t)h->reserved, "slot", (int)h->slot);
}

static int print_stats_json(const struct bd_pool_stats *s)
{
	json_t *o, *bytes, *largest = json_array(), *devices = json_array(),
		   *att = json_array();
	uint64_t used_pages = s->pages_total - s->pages_free;
	uint64_t used_slots = s->slots_total - s->slots_free;

	for (size_t i = 0; i < s->n_largest; i++)
		json_array_append_new(largest, holder_json(&s->largest[i]));
	for (size_t i = 0; i < s->n_devices; i++) {
		const struct bd_pool_device *d = &s->devices[i];

		json_array_append_new(
			devices, json_pack("{s:i, s:i, s:I, s:I, s:I, s:I}", "rank", d->rank,
					   "device", d->device, "attached", (json_int_t)d->attached,
					   "arena_bytes", (json_int_t)d->arena_bytes,
					   "page_region_bytes", (json_int_t)d->page_region_bytes,
					   "slot_region_bytes", (json_int_t)d->slot_region_bytes));
	}
	for (size_t i = 0; i < s->n_attachments; i++) {
		const struct bd_pool_attachment *a = &s->attachments[i];

		json_array_append_new(att, json_pack("{s:i, s:i, s:I, s:I}", "rank", a->rank, "pid",
						     a->pid, "uid", (json_int_t)a->uid, "gid",
						     (json_int_t)a->gid));
	}
	/* bytes on every rank together, by what they hold */
	bytes = json_object();
	json_object_set_new(bytes, s->page_format,
			    json_pack("{s:I, s:I}", "total",
				      (json_int_t)(s->pages_total * s->page_bytes * s->tp), "used",
				      (json_int_t)(used_pages * s->page_bytes * s->tp)));
	json_object_set_new(bytes, "bf16_slots",
			    json_pack("{s:I, s:I}", "total",
				      (json_int_t)(s->slots_total * s->slot_bytes * s->tp), "used",
				      (json_int_t)(used_slots * s->slot_bytes * s->tp)));
	o = json_pack("{s:s, s:s, s:s, s:i, s:i, s:{s:I, s:I, s:I, s:I, s:I}, s:{s:I, s:I}, "
		      "s:I, s:I, s:o, s:{s:I, s:I}, s:o, s:o, s:o, s:{s:I, s:I}}",
		      "backend", s->backend, "kv_config", s->kv_config, "page_format",
		      s->page_format, "tp", (int)s->tp, "max_seq_len", (int)s->max_seq_len,
		      "pages", "total", (json_int_t)s->pages_total, "free",
		      (json_int_t)s->pages_free, "used", (json_int_t)s->pages_used, "reserved",
		      (json_int_t)s->pages_reserved, "shared", (json_int_t)s->pages_shared,
		      "slots", "total", (json_int_t)s->slots_total, "free",
		      (json_int_t)s->slots_free, "page_bytes", (json_int_t)s->page_bytes,
		      "slot_bytes", (json_int_t)s->slot_bytes, "bytes", bytes, "requests",
		      "records", (json_int_t)s->requests, "holding",
		      (json_int_t)s->requests_holding, "largest", largest, "devices", devices,
		      "attachments", att, "served", "requests", (json_int_t)s->served, "errors",
		      (json_int_t)s->errors);
	if (o && json_object_set_new(o, "prefix",
				     json_pack("{s:I, s:I, s:I, s:I, s:I, s:I}", "cached",
					       (json_int_t)s->pages_cached, "idle",
					       (json_int_t)s->pages_cached_idle, "queries",
					       (json_int_t)s->prefix_queries, "hits",
					       (json_int_t)s->prefix_hits, "stored",
					       (json_int_t)s->prefix_stored, "evictions",
					       (json_int_t)s->prefix_evictions)) < 0) {
		json_decref(o);
		o = NULL;
	}
	if (!o)
		return -ENOMEM;
	json_dumpf(o, stdout, JSON_INDENT(2));
	fputc('\n', stdout);
	json_decref(o);
	return 0;
}

static void print_stats(const struct bd_pool_stats *s)
{
	uint64_t used_pages = s->pages_total - s->pages_free;
	uint64_t used_slots = s->slots_total - s->slots_free;
	char a[32], b[32], p[32], q[32];

	printf("kvpool    backend %s, kv_config %s (%s pages), tp %u, max_seq_len %u\n",
	       s->backend, s->kv_config, s->page_format, s->tp, s->max_seq_len);
	printf("pages     %" PRIu64 " total, %" PRIu64 " free, %" PRIu64 " used, %" PRIu64
	       " reserved, %" PRIu64 " shared\n",
	       s->pages_total, s->pages_free, s->pages_used, s->pages_reserved, s->pages_shared);
	printf("prefix    %" PRIu64 " pages cached (%" PRIu64 " idle, counted free), %" PRIu64
	       " of %" PRIu64 " looked up found, %" PRIu64 " stored, %" PRIu64 " evicted\n",
	       s->pages_cached, s->pages_cached_idle, s->prefix_hits, s->prefix_queries,
	       s->prefix_stored, s->prefix_evictions);
	printf("slots     %" PRIu64 " total, %" PRIu64 " free\n", s->slots_total, s->slots_free);
	human(a, sizeof(a), used_pages * s->page_bytes * s->tp);
	human(b, sizeof(b), s->pages_total * s->page_bytes * s->tp);
	human(p, sizeof(p), s->page_bytes);
	printf("bytes     %-10s %s of %s (page %s per rank, all layers)\n", s->page_format, a, b,
	       p);
	human(a, sizeof(a), used_slots * s->slot_bytes * s->tp);
	human(b, sizeof(b), s->slots_total * s->slot_bytes * s->tp);
	human(q, sizeof(q), s->slot_bytes);
	printf("          %-10s %s of %s (slot %s per rank)\n", "bf16 slots", a, b, q);
	printf("requests  %" PRIu64 " records, %" PRIu64 " holding pages or slots\n", s->requests,
	       s->requests_holding);
	printf("served    %" PRIu64 " calls, %" PRIu64 " errors\n\n", s->served, s->errors);
	printf("%-6s %-7s %-9s %-12s %-12s %-12s\n", "rank", "device", "attached", "arena",
	       "pages", "slots");
	for (size_t i = 0; i < s->n_devices; i++) {
		const struct bd_pool_device *d = &s->devices[i];

		human(a, sizeof(a), d->arena_bytes);
		human(b, sizeof(b), d->page_region_bytes);
		human(p, sizeof(p), d->slot_region_bytes);
		if (d->device >= 0)
			snprintf(q, sizeof(q), "cuda:%d", d->device);
		else
			snprintf(q, sizeof(q), "cpu");
		printf("%-6d %-7s %-9u %-12s %-12s %-12s\n", d->rank, q, d->attached, a, b, p);
	}
	if (s->n_largest) {
		printf("\nlargest holders\n%-20s %-20s %-7s %-9s %-5s\n", "request", "owner",
		       "pages", "reserved", "slot");
		for (size_t i = 0; i < s->n_largest; i++) {
			const struct bd_pool_holder *h = &s->largest[i];

			printf("%-20" PRIu64 " %-20" PRIu64 " %-7u %-9u %-5d\n", h->request_id,
			       h->owner, h->pages, h->reserved, h->slot);
		}
	}
}

static int cmd_stats(struct bd_pool_conn *c, int argc, char **argv)
{
	static const struct option lo[] = { { "json", no_argument, NULL, 'j' },
					    { "top", required_argument, NULL, 't' },
					    { 0 } };
	struct bd_pool_stats *s;
	bool json = false;
	long top = 0;
	int opt, e;

	optind = 1;
	while ((opt = getopt_long(argc, argv, "jt:", lo, NULL)) != -1) {
		if (opt == 'j') {
			json = true;
		} else if (opt == 't') {
			char *end;

			top = strtol(optarg, &end, 10);
			if (*end || top < 0 || top > 64) {
				fprintf(stderr, "kvpoolctl: --top takes 0..64\n");
				return 2;
			}
		} else {
			usage(stderr);
			return 2;
		}
	}
	e = bd_pool_stats(c, (uint32_t)top, &s);
	if (e < 0) {
		fprintf(stderr, "kvpoolctl: stats: %s\n", bd_pool_conn_error(c, NULL));
		return 1;
	}
	if (json)
		e = print_stats_json(s);
	else
		print_stats(s);
	bd_pool_stats_free(s);
	return e < 0 ? 1 : 0;
}

static int cmd_requests(struct bd_pool_conn *c, int argc, char **argv)
{
	struct bd_pool_holder *h;
	bool json = argc == 2 && !strcmp(argv[1], "--json");
	size_t n;
	int e;

	if (argc > 2 || (argc == 2 && !json)) {
		usage(stderr);
		return 2;
	}
	e = bd_pool_requests(c, &h, &n);
	if (e < 0) {
		fprintf(stderr, "kvpoolctl: requests: %s\n", bd_pool_conn_error(c, NULL));
		return 1;
	}
	if (json) {
		json_t *a = json_array();

		for (size_t i = 0; i < n; i++)
			json_array_append_new(a, holder_json(&h[i]));
		json_dumpf(a, stdout, JSON_INDENT(2));
		fputc('\n', stdout);
		json_decref(a);
	} else {
		printf("%-20s %-20s %-7s %-9s %-5s\n", "request", "owner", "pages", "reserved",
		       "slot");
		for (size_t i = 0; i < n; i++)
			printf("%-20" PRIu64 " %-20" PRIu64 " %-7u %-9u %-5d\n", h[i].request_id,
			       h[i].owner, h[i].pages, h[i].reserved, h[i].slot);
	}
	free(h);
	return 0;
}

static int parse_u64(const char *s, uint64_t *ret)
{
	char *end;

	if (!s || *s < '0' || *s > '9')
		return -EINVAL;
	errno = 0;
	*ret = strtoull(s, &end, 0);
	return *end || errno ? -EINVAL : 0;
}

static int cmd_release(struct bd_pool_conn *c, int argc, char **argv, bool owner)
{
	uint64_t id, n_req = 0, freed = 0;
	int e;

	if (argc != 2 || parse_u64(argv[1], &id) < 0) {
		usage(stderr);
		return 2;
	}
	if (owner)
		e = bd_pool_owner_reclaim(c, id, &n_req, &freed);
	else
		e = bd_pool_request_release(c, id, &freed);
	if (e < 0) {
		fprintf(stderr, "kvpoolctl: %s: %s\n", argv[0], bd_pool_conn_error(c, NULL));
		return 1;
	}
	if (owner)
		printf("released %" PRIu64 " requests, %" PRIu64 " pages freed\n", n_req, freed);
	else
		printf("released request %" PRIu64 ", %" PRIu64 " pages freed\n", id, freed);
	return 0;
}

int main(int argc, char **argv)
{
	static const struct option lo[] = { { "endpoint", required_argument, NULL, 'e' },
					    { "config", required_argument, NULL, 'c' },
					    { "no-config", no_argument, NULL, 'n' },
					    { "timeout", required_argument, NULL, 't' },
					    { "help", no_argument, NULL, 'h' },
					    { "version", no_argument, NULL, 'V' },
					    { "server-key", required_argument, NULL, 'S' },
					    { "secret-key", required_argument, NULL, 'K' },
					    { 0 } };
	const char *endpoint = NULL, *config = BD_CONFIG_DEFAULT_PATH;
	/* CURVE (kvpoold's curve_secret_key): its public key and ours */
	const char *srv_key = getenv("BDFP4_POOL_SERVER_KEY"), *sec_key = getenv("BDFP4_SECRET_KEY");
	bool explicit_config = false, no_config = false;
	struct bd_config *cfg = NULL;
	struct bd_pool_conn *c = NULL;
	int opt, timeout = 5000, rc = 1, e;

	/* "+": options stop at the command, which has its own */
	while ((opt = getopt_long(argc, argv, "+e:c:t:h", lo, NULL)) != -1) {
		switch (opt) {
		case 'e': endpoint = optarg; break;
		case 'c': config = optarg; explicit_config = true; break;
		case 'n': no_config = true; break;
		case 't': timeout = atoi(optarg); break;
		case 'h': usage(stdout); return 0;
		case 'V': printf("kvpoolctl %s\n", bd_version()); return 0;
		case 'S': srv_key = optarg; break;
		case 'K': sec_key = optarg; break;
		default: usage(stderr); return 2;
		}
	}
	if (optind >= argc || timeout <= 0) {
		usage(stderr);
		return 2;
	}
	if (!endpoint && !no_config) {
		cfg = bd_config_new();
		if (!cfg)
			return 1;
		e = bd_config_load(cfg, config, NULL);
		if (e < 0 && (e != -ENOENT || explicit_config)) {
			fprintf(stderr, "kvpoolctl: %s: %s\n", config,
				e == -EINVAL ? "syntax error" : strerror(-e));
			goto out;
		}
		endpoint = bd_config_get(cfg, "pool", "endpoint");
	}
	/* a pool that is not there fails now, with why, not after the timeout */
	e = bd_ipc_endpoint_check(endpoint, timeout);
	if (e < 0) {
		fprintf(stderr, "kvpoolctl: %s: %s%s\n", endpoint,
			e == -ENOENT ? "no such socket" : strerror(-e),
			e == -EACCES ? "" : " (is kvpoold running?)");
		goto out;
	}
	e = bd_pool_conn_new(endpoint, timeout, &c);
	if (e < 0) {
		fprintf(stderr, "kvpoolctl: %s: %s\n",
			endpoint ? endpoint : BD_POOL_DEFAULT_ENDPOINT, strerror(-e));
		goto out;
	}
	{
		char kerr[512] = "";

		e = bd_pool_conn_set_curve(c, srv_key, sec_key, kerr, sizeof(kerr));
		if (e < 0) {
			fprintf(stderr, "kvpoolctl: %s\n", *kerr ? kerr : strerror(-e));
			goto out;
		}
	}
	argc -= optind;
	argv += optind;
	if (!strcmp(argv[0], "stats")) {
		rc = cmd_stats(c, argc, argv);
	} else if (!strcmp(argv[0], "requests")) {
		rc = cmd_requests(c, argc, argv);
	} else if (!strcmp(argv[0], "release")) {
		rc = cmd_release(c, argc, argv, false);
	} else if (!strcmp(argv[0], "reclaim")) {
		rc = cmd_release(c, argc, argv, true);
	} else {
		usage(stderr);
		rc = 2;
	}
out:
	bd_pool_conn_free(c);
	bd_config_free(cfg);
	return rc;
}
