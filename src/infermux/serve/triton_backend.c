/* infermux's Triton backend: each Triton batch handed to the infermux runtime, answered later.
 *
 * `infermux serve --front triton` (serve/triton_front.py) runs Triton's C++ server as the
 * fronts. With this backend a model instance is a few hundred lines of C instead of a
 * Python-backend stub: it links to the runtime process over its Unix socket (HELLO, a text
 * INIT naming the model's slab and layout, READY), copies each request's rows into free slots
 * of the slab, sends one 28-byte descriptor per Triton batch and returns at once. A thread
 * reads the runtime's answers (DONE: the ids whose outputs are in their slots; ERROR: a JSON
 * list of [id, status, message, retry-after]) and sends each request's response from the
 * slots. So an instance holds as many batches in flight as its slab has room for (the
 * Python stub held one: every request queued behind a whole device round), and no
 * interpreter runs per request or per batch.
 *
 * Triton's backend interface is C; the declarations below are the subset this file calls,
 * as Triton's backend API (1.x) defines them. Models of one FP32 or FP16 input, or of
 * several, are served here, with FP32, FP16, INT64, INT32 or BOOL outputs (floats FP32 in the
 * slab, integers and bools as themselves); the runtime's hub falls back to the Python backend
 * for the rest.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

/* -- the subset of Triton's C interface used here -------------------------------------------- */

typedef struct TRITONSERVER_Error TRITONSERVER_Error;
typedef struct TRITONSERVER_Message TRITONSERVER_Message;
typedef struct TRITONBACKEND_Backend TRITONBACKEND_Backend;
typedef struct TRITONBACKEND_Model TRITONBACKEND_Model;
typedef struct TRITONBACKEND_ModelInstance TRITONBACKEND_ModelInstance;
typedef struct TRITONBACKEND_Request TRITONBACKEND_Request;
typedef struct TRITONBACKEND_Response TRITONBACKEND_Response;
typedef struct TRITONBACKEND_Input TRITONBACKEND_Input;
typedef struct TRITONBACKEND_Output TRITONBACKEND_Output;

enum { TYPE_BOOL = 1, TYPE_INT32 = 8, TYPE_INT64 = 9, TYPE_FP16 = 10, TYPE_FP32 = 11 };
/* ^ TRITONSERVER_DataType */
enum { MEMORY_CPU = 0, MEMORY_CPU_PINNED = 1, MEMORY_GPU = 2 }; /* TRITONSERVER_MemoryType */
enum { ERROR_INTERNAL = 1, ERROR_INVALID_ARG = 3, ERROR_UNAVAILABLE = 4 };
enum { REQUEST_RELEASE_ALL = 1, RESPONSE_COMPLETE_FINAL = 1 };

extern TRITONSERVER_Error* TRITONSERVER_ErrorNew(int code, const char* msg);
extern void TRITONSERVER_ErrorDelete(TRITONSERVER_Error* error);
extern TRITONSERVER_Error* TRITONSERVER_MessageSerializeToJson(
    TRITONSERVER_Message* message, const char** base, size_t* byte_size);
extern TRITONSERVER_Error* TRITONSERVER_MessageDelete(TRITONSERVER_Message* message);
extern TRITONSERVER_Error* TRITONBACKEND_ModelName(TRITONBACKEND_Model* model, const char** name);
extern TRITONSERVER_Error* TRITONBACKEND_ModelConfig(
    TRITONBACKEND_Model* model, uint32_t config_version, TRITONSERVER_Message** config);
extern TRITONSERVER_Error* TRITONBACKEND_ModelInstanceModel(
    TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Model** model);
extern TRITONSERVER_Error* TRITONBACKEND_ModelInstanceState(
    TRITONBACKEND_ModelInstance* instance, void** state);
extern TRITONSERVER_Error* TRITONBACKEND_ModelInstanceSetState(
    TRITONBACKEND_ModelInstance* instance, void* state);
extern TRITONSERVER_Error* TRITONBACKEND_ModelInstanceReportStatistics(
    TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Request* request, bool success,
    uint64_t exec_start_ns, uint64_t compute_start_ns, uint64_t compute_end_ns,
    uint64_t exec_end_ns);
extern TRITONSERVER_Error* TRITONBACKEND_ModelInstanceReportBatchStatistics(
    TRITONBACKEND_ModelInstance* instance, uint64_t batch_size, uint64_t exec_start_ns,
    uint64_t compute_start_ns, uint64_t compute_end_ns, uint64_t exec_end_ns);
extern TRITONSERVER_Error* TRITONBACKEND_RequestInputCount(
    TRITONBACKEND_Request* request, uint32_t* count);
extern TRITONSERVER_Error* TRITONBACKEND_RequestInput(
    TRITONBACKEND_Request* request, const char* name, TRITONBACKEND_Input** input);
extern TRITONSERVER_Error* TRITONBACKEND_RequestInputByIndex(
    TRITONBACKEND_Request* request, uint32_t index, TRITONBACKEND_Input** input);
extern TRITONSERVER_Error* TRITONBACKEND_InputProperties(
    TRITONBACKEND_Input* input, const char** name, int* datatype, const int64_t** shape,
    uint32_t* dims_count, uint64_t* byte_size, uint32_t* buffer_count);
extern TRITONSERVER_Error* TRITONBACKEND_InputBuffer(
    TRITONBACKEND_Input* input, uint32_t index, const void** buffer, uint64_t* byte_size,
    int* memory_type, int64_t* memory_type_id);
extern TRITONSERVER_Error* TRITONBACKEND_RequestOutputCount(
    TRITONBACKEND_Request* request, uint32_t* count);
extern TRITONSERVER_Error* TRITONBACKEND_RequestOutputName(
    TRITONBACKEND_Request* request, uint32_t index, const char** name);
extern TRITONSERVER_Error* TRITONBACKEND_RequestRelease(
    TRITONBACKEND_Request* request, uint32_t release_flags);
extern TRITONSERVER_Error* TRITONBACKEND_ResponseNew(
    TRITONBACKEND_Response** response, TRITONBACKEND_Request* request);
extern TRITONSERVER_Error* TRITONBACKEND_ResponseOutput(
    TRITONBACKEND_Response* response, TRITONBACKEND_Output** output, const char* name,
    int datatype, const int64_t* shape, uint32_t dims_count);
extern TRITONSERVER_Error* TRITONBACKEND_OutputBuffer(
    TRITONBACKEND_Output* output, void** buffer, uint64_t byte_size, int* memory_type,
    int64_t* memory_type_id);
extern TRITONSERVER_Error* TRITONBACKEND_ResponseSend(
    TRITONBACKEND_Response* response, uint32_t send_flags, TRITONSERVER_Error* error);

/* -- the link's frames (serve/proxy.py) ------------------------------------------------------ */

enum { K_INIT = 1, K_READY = 2, K_INFER = 3, K_DONE = 4, K_ERROR = 5, K_REFUSED = 10,
       K_SHAPED = 11, K_HELLO = 12 };
#define HEADER_BYTES 5
#define REQUEST_BYTES 28
#define MAX_OUTPUTS 16
#define MAX_INPUTS 16
#define MAX_DIMS 8
#define GROUP_BUCKETS 1024

typedef struct {
  TRITONBACKEND_Request* request;
  uint32_t items;
  uint32_t length; /* its sequence length (a model of several inputs with one), else 0 */
} Item;

/* Requests of one Triton batch (of one length): their rows in `total` contiguous slots from
 * `start`. */
typedef struct Group {
  uint64_t id;
  uint32_t start, total, count, length;
  uint64_t exec_start_ns;
  Item* items;
  struct Group* next;
} Group;

typedef struct {
  char name[256];
  int datatype;
  uint32_t ndims;
  int64_t dims[MAX_DIMS];
  uint32_t itemsize;   /* bytes of one value in the slab: floats FP32, integers their own */
  uint64_t item_bytes; /* in the slab: at the longest length for a model of several */
} Output;

/* An input of a model of several: its bytes per element and item shape (-1: the length). */
typedef struct {
  char name[256];
  uint32_t itemsize, ndims;
  int64_t dims[MAX_DIMS];
} Input;

/* Each output's item shape as the runtime answered it (SHAPED: it follows the length). */
typedef struct {
  uint32_t ndims[MAX_OUTPUTS];
  int64_t dims[MAX_OUTPUTS][MAX_DIMS];
} Shapes;

typedef struct {
  TRITONBACKEND_ModelInstance* instance;
  char model[256];
  char link_path[1024];
  pthread_mutex_t mu;      /* slots, groups, the link */
  pthread_mutex_t send_mu; /* whole frames on the socket */
  int fd;
  uint64_t generation;     /* which link a reader thread serves */
  uint8_t* slab;
  size_t slab_bytes;
  uint32_t slots, index;
  uint8_t code;            /* the descriptor's dtype code: 0 FP32, 1 FP16 */
  uint64_t in_item_bytes, row_bytes;
  bool several;            /* a model of several inputs (the slab's `several` layout) */
  bool fixed_outputs;      /* ... whose outputs have one shape whatever the length */
  uint32_t n_inputs, max_length;
  Input inputs[MAX_INPUTS];
  uint32_t n_outputs;
  Output outputs[MAX_OUTPUTS];
  uint64_t out_item_bytes; /* all outputs of one item */
  uint8_t* used;           /* per slot: 1 while a request holds it */
  uint32_t lowest;         /* no slot below it is free */
  Group* groups[GROUP_BUCKETS];
  uint64_t next_id;
} Instance;

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static TRITONSERVER_Error* fail(int code, const char* fmt, ...) {
  char text[1024];
  va_list args;
  va_start(args, fmt);
  vsnprintf(text, sizeof text, fmt, args);
  va_end(args);
  return TRITONSERVER_ErrorNew(code, text);
}

/* All of `size` bytes sent (`out`) or received on `fd`; -1 where the link ended. */
static int transfer_all(int fd, void* data, size_t size, bool out) {
  uint8_t* p = data;
  while (size) {
    ssize_t n = out ? send(fd, p, size, MSG_NOSIGNAL) : recv(fd, p, size, 0);
    if (n == 0 && !out) return -1;
    if (n < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    p += n;
    size -= (size_t)n;
  }
  return 0;
}

/* A whole frame on `fd`; with `live`, only while `fd` is still the instance's link (a reader
 * that saw it end closes it under `send_mu`, and its number may be another file's then). */
static int send_frame(Instance* s, int fd, uint8_t kind, const void* payload, uint32_t size,
                      bool live) {
  uint8_t header[HEADER_BYTES];
  memcpy(header, &size, 4);
  header[4] = kind;
  pthread_mutex_lock(&s->send_mu);
  if (live && s->fd != fd) {
    pthread_mutex_unlock(&s->send_mu);
    return -1;
  }
  int rc = transfer_all(fd, header, HEADER_BYTES, true);
  if (rc == 0 && size) rc = transfer_all(fd, (void*)payload, size, true);
  pthread_mutex_unlock(&s->send_mu);
  return rc;
}

/* A frame's payload (malloc'd) and kind; -1 when the link is gone. */
static int read_frame(int fd, uint8_t* kind, uint8_t** payload, uint32_t* size) {
  uint8_t header[HEADER_BYTES];
  if (transfer_all(fd, header, HEADER_BYTES, false) < 0) return -1;
  memcpy(size, header, 4);
  *kind = header[4];
  *payload = malloc(*size + 1);
  if (*payload == NULL) return -1;
  if (*size && transfer_all(fd, *payload, *size, false) < 0) {
    free(*payload);
    return -1;
  }
  (*payload)[*size] = 0;
  return 0;
}

/* -- slots ----------------------------------------------------------------------------------- */

static int64_t find_run(const Instance* s, uint32_t from, uint32_t n) {
  uint32_t run = 0;
  for (uint32_t i = from; i < s->slots; ++i) {
    run = s->used[i] ? 0 : run + 1;
    if (run == n) return (int64_t)i + 1 - n;
  }
  return -1;
}

/* The first of `n` contiguous free slots (marked used), or -1. Under `mu`. The lowest free
 * run, as a front process takes them: the slab's pages in use (and those the runtime locks
 * for DMA to a GPU) stay few and warm. */
static int64_t take_slots(Instance* s, uint32_t n) {
  if (n == 0 || n > s->slots) return -1;
  int64_t start = find_run(s, s->lowest, n);
  if (start >= 0) {
    memset(s->used + start, 1, n);
    if ((uint32_t)start == s->lowest) {
      while (s->lowest < s->slots && s->used[s->lowest]) ++s->lowest;
    }
  }
  return start;
}

static void give_slots(Instance* s, uint32_t start, uint32_t n) {
  memset(s->used + start, 0, n);
  if (start < s->lowest) s->lowest = start;
}

/* -- answers --------------------------------------------------------------------------------- */

static Group* pop_group(Instance* s, uint64_t id) {
  Group** at = &s->groups[id % GROUP_BUCKETS];
  for (; *at; at = &(*at)->next) {
    if ((*at)->id == id) {
      Group* g = *at;
      *at = g->next;
      return g;
    }
  }
  return NULL;
}

static void respond_error(Instance* s, TRITONBACKEND_Request* request, int code,
                          const char* message) {
  TRITONBACKEND_Response* response = NULL;
  TRITONSERVER_Error* err = TRITONBACKEND_ResponseNew(&response, request);
  if (err == NULL) {
    TRITONSERVER_Error* error = TRITONSERVER_ErrorNew(code, message);
    TRITONSERVER_Error* sent = TRITONBACKEND_ResponseSend(response, RESPONSE_COMPLETE_FINAL,
                                                          error);
    if (sent) TRITONSERVER_ErrorDelete(sent);
    TRITONSERVER_ErrorDelete(error);
  } else {
    TRITONSERVER_ErrorDelete(err);
  }
  uint64_t t = now_ns();
  TRITONSERVER_Error* e = TRITONBACKEND_ModelInstanceReportStatistics(s->instance, request,
                                                                      false, t, t, t, t);
  if (e) TRITONSERVER_ErrorDelete(e);
  e = TRITONBACKEND_RequestRelease(request, REQUEST_RELEASE_ALL);
  if (e) TRITONSERVER_ErrorDelete(e);
}

/* IEEE half from float, rounded to nearest even (exported for the tests; no compiler's
 * _Float16 needed). */
uint16_t infermux_to_half(float f);
uint16_t infermux_to_half(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u, bits = (x >> 23) & 0xffu, mant = x & 0x7fffffu;
  if (bits == 0xff) return (uint16_t)(sign | 0x7c00u | (mant ? 0x200u : 0));
  int32_t exp = (int32_t)bits - 127 + 15;
  if (exp >= 31) return (uint16_t)(sign | 0x7c00u);
  if (exp <= 0) {
    if (exp < -10) return (uint16_t)sign;
    mant |= 0x800000u;
    uint32_t shift = (uint32_t)(14 - exp), half = mant >> shift;
    uint32_t rest = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rest > mid || (rest == mid && (half & 1u))) ++half;
    return (uint16_t)(sign | half);
  }
  uint32_t half = sign | ((uint32_t)exp << 10) | (mant >> 13), rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half; /* a carry is still right */
  return (uint16_t)half;
}

static uint64_t elements_of(const int64_t* dims, uint32_t ndims) {
  uint64_t n = 1;
  for (uint32_t d = 0; d < ndims; ++d) n *= (uint64_t)dims[d];
  return n;
}

/* One request's response from its slots: the outputs it asked for (Triton fills in all of
 * them when it named none). Its rows are the group's `at`-th to `at + items`; `shapes`: the
 * outputs' item shapes as answered (NULL: the model's own). */
static const char* respond(Instance* s, const Group* g, const Item* item, uint32_t at,
                           const Shapes* shapes) {
  TRITONBACKEND_Response* response = NULL;
  TRITONSERVER_Error* err = TRITONBACKEND_ResponseNew(&response, item->request);
  if (err) {
    TRITONSERVER_ErrorDelete(err);
    return "no response could be made";
  }
  const char* problem = NULL;
  uint32_t wanted = 0;
  err = TRITONBACKEND_RequestOutputCount(item->request, &wanted);
  if (err) {
    TRITONSERVER_ErrorDelete(err);
    wanted = 0;
  }
  /* The group's outputs: each output's `total` rows one after another, from its slots. */
  const uint8_t* region = s->slab + (uint64_t)s->slots * s->in_item_bytes
                          + (uint64_t)g->start * s->out_item_bytes;
  for (uint32_t w = 0; w < wanted && problem == NULL; ++w) {
    const char* name = NULL;
    err = TRITONBACKEND_RequestOutputName(item->request, w, &name);
    if (err) {
      TRITONSERVER_ErrorDelete(err);
      problem = "an output name could not be read";
      break;
    }
    uint32_t k = 0;
    uint64_t offset = 0;
    while (k < s->n_outputs && strcmp(s->outputs[k].name, name) != 0) {
      uint64_t per = shapes ? elements_of(shapes->dims[k], shapes->ndims[k])
                                  * s->outputs[k].itemsize
                            : s->outputs[k].item_bytes;
      offset += (uint64_t)g->total * per;
      ++k;
    }
    if (k == s->n_outputs) {
      problem = "a requested output is not the model's";
      break;
    }
    const Output* o = &s->outputs[k];
    const int64_t* dims = shapes ? shapes->dims[k] : o->dims;
    uint32_t ndims = shapes ? shapes->ndims[k] : o->ndims;
    uint64_t per_item = elements_of(dims, ndims);
    int64_t shape[MAX_DIMS + 1];
    shape[0] = item->items;
    memcpy(shape + 1, dims, ndims * sizeof(int64_t));
    TRITONBACKEND_Output* output = NULL;
    err = TRITONBACKEND_ResponseOutput(response, &output, o->name, o->datatype, shape,
                                       ndims + 1);
    if (err) {
      TRITONSERVER_ErrorDelete(err);
      problem = "an output could not be added to the response";
      break;
    }
    uint64_t elements = per_item * item->items;
    uint64_t bytes = elements * (o->datatype == TYPE_FP16 ? 2 : o->itemsize);
    void* buffer = NULL;
    int memory_type = MEMORY_CPU;
    int64_t memory_id = 0;
    err = TRITONBACKEND_OutputBuffer(output, &buffer, bytes, &memory_type, &memory_id);
    if (err) {
      TRITONSERVER_ErrorDelete(err);
      problem = "no output buffer";
      break;
    }
    if (memory_type == MEMORY_GPU) {
      problem = "an output in GPU memory (CUDA shared memory) is not written by the native "
                "backend: use system shared memory or none, or serve with --triton-backend python";
      break;
    }
    const uint8_t* rows = region + offset + (uint64_t)at * per_item * o->itemsize;
    if (o->datatype == TYPE_FP16) {
      const float* values = (const float*)rows;
      uint16_t* dst = buffer;
      for (uint64_t i = 0; i < elements; ++i) dst[i] = infermux_to_half(values[i]);
    } else {
      memcpy(buffer, rows, bytes);
    }
  }
  TRITONSERVER_Error* error = problem ? TRITONSERVER_ErrorNew(ERROR_INTERNAL, problem) : NULL;
  err = TRITONBACKEND_ResponseSend(response, RESPONSE_COMPLETE_FINAL, error);
  if (err) TRITONSERVER_ErrorDelete(err);
  if (error) TRITONSERVER_ErrorDelete(error);
  return problem;
}

static void answer_group(Instance* s, Group* g, const Shapes* shapes) {
  uint64_t done = now_ns();
  uint32_t at = 0;
  for (uint32_t i = 0; i < g->count; ++i) {
    const char* problem = respond(s, g, &g->items[i], at, shapes);
    at += g->items[i].items;
    TRITONSERVER_Error* e = TRITONBACKEND_ModelInstanceReportStatistics(
        s->instance, g->items[i].request, problem == NULL, g->exec_start_ns, g->exec_start_ns,
        done, done);
    if (e) TRITONSERVER_ErrorDelete(e);
    e = TRITONBACKEND_RequestRelease(g->items[i].request, REQUEST_RELEASE_ALL);
    if (e) TRITONSERVER_ErrorDelete(e);
  }
  TRITONSERVER_Error* e = TRITONBACKEND_ModelInstanceReportBatchStatistics(
      s->instance, g->total, g->exec_start_ns, g->exec_start_ns, done, done);
  if (e) TRITONSERVER_ErrorDelete(e);
}

static void fail_group(Instance* s, Group* g, int code, const char* message) {
  for (uint32_t i = 0; i < g->count; ++i) respond_error(s, g->items[i].request, code, message);
}

/* Gives a group's slots back and frees it (its requests answered or failed already). */
static void release_group(Instance* s, Group* g) {
  pthread_mutex_lock(&s->mu);
  give_slots(s, g->start, g->total);
  pthread_mutex_unlock(&s->mu);
  free(g->items);
  free(g);
}

/* Group `id`, where still held: answered from its slots (at `shapes`; NULL: the model's own),
 * or failed with `code` and `message` where a message is given; then released. */
static void finish_group(Instance* s, uint64_t id, const Shapes* shapes, int code,
                         const char* message) {
  pthread_mutex_lock(&s->mu);
  Group* g = pop_group(s, id);
  pthread_mutex_unlock(&s->mu);
  if (g == NULL) return;
  if (message)
    fail_group(s, g, code, message);
  else
    answer_group(s, g, shapes);
  release_group(s, g);
}

/* The runtime's status as Triton's: 503 and 429 are UNAVAILABLE, 400 and 413 the client's. */
static int error_code(long status) {
  if (status == 503 || status == 429) return ERROR_UNAVAILABLE;
  if (status == 400 || status == 413 || status == 404) return ERROR_INVALID_ARG;
  return ERROR_INTERNAL;
}

/* ERROR's payload: [[id, status, "message", retry_after_s], ...] (JSON, as the hub writes). */
static void on_errors(Instance* s, char* text) {
  char* p = text;
  while ((p = strchr(p, '[')) != NULL) {
    ++p;
    if (*p == '[') continue;
    char* end = NULL;
    uint64_t id = strtoull(p, &end, 10);
    if (end == p) continue;
    p = strchr(end, ',');
    if (!p) break;
    long status = strtol(p + 1, &end, 10);
    p = strchr(end, '"');
    char message[1024];
    size_t m = 0;
    if (p) {
      for (++p; *p && *p != '"'; ++p) {
        char c = *p;
        if (c == '\\' && p[1]) c = *++p == 'n' ? ' ' : *p;
        if (m + 1 < sizeof message) message[m++] = c;
      }
    }
    message[m] = 0;
    finish_group(s, id, NULL, error_code(status), message[0] ? message : "the runtime refused it");
    if (!p) break;
  }
}

/* Every request still waiting on a link that is gone: answered UNAVAILABLE. Under `mu`:
 * the groups are taken, then answered with the lock released. */
static void fail_all(Instance* s, const char* message) {
  Group* all = NULL;
  pthread_mutex_lock(&s->mu);
  for (int b = 0; b < GROUP_BUCKETS; ++b) {
    while (s->groups[b]) {
      Group* g = s->groups[b];
      s->groups[b] = g->next;
      g->next = all;
      all = g;
    }
  }
  pthread_mutex_unlock(&s->mu);
  while (all) {
    Group* g = all;
    all = g->next;
    fail_group(s, g, ERROR_UNAVAILABLE, message);
    free(g->items);
    free(g);
  }
}

static const char* skip_separators(const char* p) {
  while (*p == ' ' || *p == ',' || *p == '\n') ++p;
  return p;
}

/* Past the separators at `*p`: whether a list closes there (then past its `]`). */
static bool list_closes(const char** p) {
  *p = skip_separators(*p);
  if (**p != ']') return false;
  ++*p;
  return true;
}

/* SHAPED's payload: [[id, [[dim, ...], ...]], ...] (JSON, as the hub writes). */
static void on_shaped(Instance* s, const char* p) {
  p = skip_separators(p);
  if (*p++ != '[') return;
  for (;;) {
    p = skip_separators(p);
    if (*p != '[') return;
    char* end = NULL;
    uint64_t id = strtoull(p + 1, &end, 10);
    if (end == p + 1) return;
    p = skip_separators(end);
    if (*p++ != '[') return;
    Shapes shapes;
    memset(&shapes, 0, sizeof shapes);
    uint32_t k = 0;
    while (!list_closes(&p)) {
      if (*p++ != '[') return;
      uint32_t d = 0;
      while (!list_closes(&p)) {
        long long v = strtoll(p, &end, 10);
        if (end == p) return;
        if (k < MAX_OUTPUTS && d < MAX_DIMS) shapes.dims[k][d] = v;
        ++d;
        p = end;
      }
      if (k < MAX_OUTPUTS) shapes.ndims[k] = d < MAX_DIMS ? d : MAX_DIMS;
      ++k;
    }
    list_closes(&p); /* the item's own `]` */
    finish_group(s, id, &shapes, ERROR_INTERNAL,
                 k == s->n_outputs ? NULL : "the runtime answered another number of outputs");
  }
}

typedef struct {
  Instance* s;
  int fd;
  uint64_t generation;
} ReaderArgs;

static void* reader(void* arg) {
  ReaderArgs a = *(ReaderArgs*)arg;
  free(arg);
  Instance* s = a.s;
  for (;;) {
    uint8_t kind;
    uint8_t* payload = NULL;
    uint32_t size = 0;
    if (read_frame(a.fd, &kind, &payload, &size) < 0) break;
    if (kind == K_DONE) {
      for (uint32_t at = 0; at + 8 <= size; at += 8) {
        uint64_t id;
        memcpy(&id, payload + at, 8);
        finish_group(s, id, NULL, 0, NULL);
      }
    } else if (kind == K_ERROR) {
      on_errors(s, (char*)payload);
    } else if (kind == K_SHAPED) {
      on_shaped(s, (const char*)payload);
    }
    free(payload);
  }
  /* The link is gone: whatever it still owed is answered, and the next batch links anew. */
  pthread_mutex_lock(&s->mu);
  pthread_mutex_lock(&s->send_mu);
  bool current = s->generation == a.generation && s->fd == a.fd;
  if (current) s->fd = -1;
  close(a.fd);
  pthread_mutex_unlock(&s->send_mu);
  pthread_mutex_unlock(&s->mu);
  if (current) fail_all(s, "the infermux runtime closed its link: retry");
  return NULL;
}

/* -- linking to the runtime ------------------------------------------------------------------ */

static const char* config_string(const char* json, const char* key, char* out, size_t size) {
  /* "key":{"string_value":"VALUE"} in the model configuration's JSON */
  char pattern[300];
  snprintf(pattern, sizeof pattern, "\"%s\"", key);
  const char* p = strstr(json, pattern);
  if (!p) return NULL;
  p = strstr(p, "\"string_value\"");
  if (!p) return NULL;
  p = strchr(p + 14, '"');
  if (!p) return NULL;
  ++p;
  size_t n = 0;
  while (p[n] && p[n] != '"' && n + 1 < size) {
    out[n] = p[n];
    ++n;
  }
  out[n] = 0;
  return out;
}

/* INIT for this backend: lines of "key value..." (serve/triton_front.py, `native_init`). */
static const char* parse_init(Instance* s, char* text, char* slab_name, size_t name_size) {
  s->n_outputs = s->n_inputs = 0;
  s->out_item_bytes = 0;
  s->several = s->fixed_outputs = false;
  s->max_length = 1;
  s->row_bytes = 1; /* a model of several inputs has none: its inputs' lines say */
  slab_name[0] = 0;
  for (char* line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
    char key[32];
    int used = 0;
    if (sscanf(line, "%31s %n", key, &used) != 1) continue;
    char* rest = line + used;
    if (!strcmp(key, "index")) s->index = (uint32_t)strtoul(rest, NULL, 10);
    else if (!strcmp(key, "slots")) s->slots = (uint32_t)strtoul(rest, NULL, 10);
    else if (!strcmp(key, "code")) s->code = (uint8_t)strtoul(rest, NULL, 10);
    else if (!strcmp(key, "input_item_bytes")) s->in_item_bytes = strtoull(rest, NULL, 10);
    else if (!strcmp(key, "row_bytes")) s->row_bytes = strtoull(rest, NULL, 10);
    else if (!strcmp(key, "slab")) snprintf(slab_name, name_size, "%s", rest);
    else if (!strcmp(key, "error")) return strdup(rest);
    else if (!strcmp(key, "several")) s->several = strtoul(rest, NULL, 10) != 0;
    else if (!strcmp(key, "fixed_outputs")) s->fixed_outputs = strtoul(rest, NULL, 10) != 0;
    else if (!strcmp(key, "max_length")) s->max_length = (uint32_t)strtoul(rest, NULL, 10);
    else if (!strcmp(key, "input")) {
      if (s->n_inputs == MAX_INPUTS) return "more inputs than this backend takes";
      Input* in = &s->inputs[s->n_inputs];
      int n = 0;
      if (sscanf(rest, "%255s %u %u %n", in->name, &in->itemsize, &in->ndims, &n) != 3
          || in->ndims > MAX_DIMS)
        return "a malformed input line in INIT";
      char* p = rest + n;
      for (uint32_t d = 0; d < in->ndims; ++d) in->dims[d] = strtoll(p, &p, 10);
      ++s->n_inputs;
    }
    else if (!strcmp(key, "output")) {
      if (s->n_outputs == MAX_OUTPUTS) return "more outputs than this backend takes";
      Output* o = &s->outputs[s->n_outputs];
      char dtype[16];
      int n = 0;
      if (sscanf(rest, "%255s %15s %u %n", o->name, dtype, &o->ndims, &n) != 3
          || o->ndims > MAX_DIMS)
        return "a malformed output line in INIT";
      if (!strcmp(dtype, "FP16")) o->datatype = TYPE_FP16, o->itemsize = 4;
      else if (!strcmp(dtype, "FP32")) o->datatype = TYPE_FP32, o->itemsize = 4;
      else if (!strcmp(dtype, "INT64")) o->datatype = TYPE_INT64, o->itemsize = 8;
      else if (!strcmp(dtype, "INT32")) o->datatype = TYPE_INT32, o->itemsize = 4;
      else if (!strcmp(dtype, "BOOL")) o->datatype = TYPE_BOOL, o->itemsize = 1;
      else return "an output of a datatype this backend does not answer";
      char* p = rest + n;
      for (uint32_t d = 0; d < o->ndims; ++d) o->dims[d] = strtoll(p, &p, 10);
      o->item_bytes = elements_of(o->dims, o->ndims) * o->itemsize;
      s->out_item_bytes += o->item_bytes;
      ++s->n_outputs;
    }
  }
  if (!slab_name[0] || !s->slots || !s->in_item_bytes || !s->n_outputs
      || (s->several && !s->n_inputs))
    return "INIT is missing the slab, its slots, its inputs or its outputs";
  return NULL;
}

/* HELLO, INIT, the slab mapped, READY, the reader started. Under `mu`; NULL or what failed. */
static TRITONSERVER_Error* link_up(Instance* s) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return fail(ERROR_UNAVAILABLE, "no socket: %s", strerror(errno));
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  if (strlen(s->link_path) >= sizeof addr.sun_path) {
    close(fd);
    return fail(ERROR_INVALID_ARG, "the link path %s is too long for a Unix socket",
                s->link_path);
  }
  memcpy(addr.sun_path, s->link_path, strlen(s->link_path) + 1);
  if (connect(fd, (struct sockaddr*)&addr, sizeof addr) < 0) {
    int e = errno;
    close(fd);
    return fail(ERROR_UNAVAILABLE, "the infermux runtime's link %s: %s", s->link_path,
                strerror(e));
  }
  char hello[512];
  int n = snprintf(hello, sizeof hello, "{\"model\": \"%s\", \"pid\": %d, \"init\": \"text\"}",
                   s->model, (int)getpid());
  uint8_t kind;
  uint8_t* payload = NULL;
  uint32_t size;
  if (send_frame(s, fd, K_HELLO, hello, (uint32_t)n, false) < 0
      || read_frame(fd, &kind, &payload, &size) < 0) {
    close(fd);
    return fail(ERROR_UNAVAILABLE, "the infermux runtime closed the link before INIT");
  }
  if (kind != K_INIT) {
    free(payload);
    close(fd);
    return fail(ERROR_INTERNAL, "expected INIT from the infermux runtime, got frame %d", kind);
  }
  char slab_name[256];
  const char* problem = parse_init(s, (char*)payload, slab_name, sizeof slab_name);
  free(payload);
  if (problem) {
    close(fd);
    return fail(ERROR_INTERNAL, "infermux runtime: %s", problem);
  }
  if (s->slab) munmap(s->slab, s->slab_bytes);
  s->slab = NULL;
  char path[300];
  snprintf(path, sizeof path, "%s%s", slab_name[0] == '/' ? "" : "/", slab_name);
  int shm = shm_open(path, O_RDWR, 0);
  if (shm < 0) {
    close(fd);
    return fail(ERROR_INTERNAL, "slab %s: %s", path, strerror(errno));
  }
  s->slab_bytes = (size_t)s->slots * (s->in_item_bytes + s->out_item_bytes);
  void* map = mmap(NULL, s->slab_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, shm, 0);
  close(shm);
  if (map == MAP_FAILED) {
    close(fd);
    return fail(ERROR_INTERNAL, "slab %s: %s", path, strerror(errno));
  }
  s->slab = map;
  free(s->used);
  s->used = calloc(s->slots, 1);
  s->lowest = 0;
  char ready[64];
  n = snprintf(ready, sizeof ready, "{\"pid\": %d}", (int)getpid());
  if (send_frame(s, fd, K_READY, ready, (uint32_t)n, false) < 0) {
    close(fd);
    return fail(ERROR_UNAVAILABLE, "the infermux runtime closed the link after INIT");
  }
  s->fd = fd;
  s->generation += 1;
  ReaderArgs* args = malloc(sizeof *args);
  *args = (ReaderArgs){s, fd, s->generation};
  pthread_t thread;
  if (pthread_create(&thread, NULL, reader, args) != 0) {
    free(args);
    close(fd);
    s->fd = -1;
    return fail(ERROR_INTERNAL, "no reader thread");
  }
  pthread_detach(thread);
  return NULL;
}

/* -- Triton's entry points ------------------------------------------------------------------- */

TRITONSERVER_Error* TRITONBACKEND_ModelInstanceInitialize(TRITONBACKEND_ModelInstance* instance) {
  TRITONBACKEND_Model* model = NULL;
  TRITONSERVER_Error* err = TRITONBACKEND_ModelInstanceModel(instance, &model);
  if (err) return err;
  const char* name = NULL;
  if ((err = TRITONBACKEND_ModelName(model, &name))) return err;
  TRITONSERVER_Message* config = NULL;
  if ((err = TRITONBACKEND_ModelConfig(model, 1, &config))) return err;
  const char* json = NULL;
  size_t json_size = 0;
  if ((err = TRITONSERVER_MessageSerializeToJson(config, &json, &json_size))) {
    TRITONSERVER_MessageDelete(config);
    return err;
  }
  Instance* s = calloc(1, sizeof *s);
  s->instance = instance;
  s->fd = -1;
  snprintf(s->model, sizeof s->model, "%s", name);
  const char* link = config_string(json, "infermux_link", s->link_path, sizeof s->link_path);
  TRITONSERVER_MessageDelete(config);
  if (!link) {
    free(s);
    return fail(ERROR_INVALID_ARG, "model %s names no infermux_link parameter", name);
  }
  pthread_mutex_init(&s->mu, NULL);
  pthread_mutex_init(&s->send_mu, NULL);
  pthread_mutex_lock(&s->mu);
  err = link_up(s);
  pthread_mutex_unlock(&s->mu);
  if (err) {
    free(s);
    return err;
  }
  return TRITONBACKEND_ModelInstanceSetState(instance, s);
}

TRITONSERVER_Error* TRITONBACKEND_ModelInstanceFinalize(TRITONBACKEND_ModelInstance* instance) {
  void* state = NULL;
  TRITONSERVER_Error* err = TRITONBACKEND_ModelInstanceState(instance, &state);
  if (err || !state) return err;
  Instance* s = state;
  pthread_mutex_lock(&s->mu);
  s->generation += 1; /* the reader's exit is then not this instance's concern */
  if (s->fd >= 0) shutdown(s->fd, SHUT_RDWR);
  pthread_mutex_unlock(&s->mu);
  fail_all(s, "the model is unloading");
  /* The reader may still be in a read that the shutdown ends; the slab stays mapped (the
   * process exits with the server) so that a late answer writes nothing freed. */
  return NULL;
}

/* Copies `size` bytes of a request's input, which start `offset` bytes into its rows, to the
 * slab: rows of `row_bytes` into slots `in_item_bytes` apart. */
static void put_rows(Instance* s, uint32_t first_slot, uint64_t offset, const uint8_t* src,
                     uint64_t size) {
  while (size) {
    uint64_t row = offset / s->row_bytes, within = offset % s->row_bytes;
    uint64_t n = s->row_bytes - within;
    if (n > size) n = size;
    if (within == 0 && s->row_bytes == s->in_item_bytes) {
      n = size - size % s->row_bytes;
      if (n == 0) n = size;
    }
    memcpy(s->slab + (uint64_t)(first_slot + row) * s->in_item_bytes + within, src, n);
    src += n;
    offset += n;
    size -= n;
  }
}

/* Bytes of one item of input `k` of a model of several at sequence length `length`. */
static uint64_t input_item_bytes(const Instance* s, uint32_t k, uint32_t length) {
  const Input* in = &s->inputs[k];
  uint64_t n = in->itemsize;
  for (uint32_t d = 0; d < in->ndims; ++d) n *= (uint64_t)(in->dims[d] < 0 ? length : in->dims[d]);
  return n;
}

/* A request's input `k` (by index for a model of one input, by name for several). */
static TRITONSERVER_Error* request_input(const Instance* s, TRITONBACKEND_Request* request,
                                         uint32_t k, TRITONBACKEND_Input** input) {
  return s->several ? TRITONBACKEND_RequestInput(request, s->inputs[k].name, input)
                    : TRITONBACKEND_RequestInputByIndex(request, 0, input);
}

/* Checks a request's inputs against the slab's layout: its items and sequence length, or the
 * reason it cannot be taken. */
static const char* check_request(const Instance* s, TRITONBACKEND_Request* request,
                                 uint32_t* items, uint32_t* length) {
  *items = 0;
  *length = 0;
  uint32_t inputs = s->several ? s->n_inputs : 1;
  for (uint32_t k = 0; k < inputs; ++k) {
    TRITONBACKEND_Input* input = NULL;
    const char* name;
    int datatype;
    const int64_t* shape;
    uint32_t dims = 0, buffers = 0;
    uint64_t bytes = 0;
    TRITONSERVER_Error* err = request_input(s, request, k, &input);
    if (!err)
      err = TRITONBACKEND_InputProperties(input, &name, &datatype, &shape, &dims, &bytes,
                                          &buffers);
    if (err) {
      TRITONSERVER_ErrorDelete(err);
      return "the request's inputs could not be read";
    }
    uint32_t n = dims ? (uint32_t)shape[0] : 1;
    if (n == 0 || (k > 0 && n != *items)) return "the inputs' batch sizes differ";
    *items = n;
    if (!s->several) {
      if (bytes != (uint64_t)n * s->row_bytes)
        return "the input's bytes do not fit its shape and datatype";
      continue;
    }
    const Input* in = &s->inputs[k];
    if (dims != in->ndims + 1) return "an input's rank is not the model's";
    for (uint32_t d = 0; d < in->ndims; ++d) {
      if (in->dims[d] >= 0) continue;
      uint32_t given = (uint32_t)shape[d + 1];
      if (*length && given != *length) return "the inputs' sequence lengths differ";
      if (given == 0 || given > s->max_length)
        return "the sequence length is not one the plan compiles (0 or past its longest)";
      *length = given;
    }
    if (bytes != (uint64_t)n * input_item_bytes(s, k, *length ? *length : 1))
      return "an input's bytes do not fit its shape and datatype";
  }
  return NULL;
}

/* Copies the rows of `count` requests (`total` items of one length) into the slots from
 * `first` and hands them to the runtime as one descriptor; answers them itself where that
 * fails. */
static void submit(Instance* s, const Item* items, uint32_t count, uint32_t total,
                   uint64_t start_ns) {
  pthread_mutex_lock(&s->mu);
  int64_t first = take_slots(s, total);
  if (first < 0) {
    int link = s->fd;
    pthread_mutex_unlock(&s->mu);
    char why[512];
    snprintf(why, sizeof why, "model '%s' holds its admission limit in this instance's queue: "
             "retry later", s->model);
    for (uint32_t i = 0; i < count; ++i) respond_error(s, items[i].request, ERROR_UNAVAILABLE, why);
    /* Counted by the runtime with the refusals it makes itself (REFUSALS: index, requests). */
    uint8_t refused[6];
    uint16_t index = (uint16_t)s->index;
    memcpy(refused, &index, 2);
    memcpy(refused + 2, &count, 4);
    if (link >= 0) send_frame(s, link, K_REFUSED, refused, sizeof refused, true);
    return;
  }
  Group* g = calloc(1, sizeof *g);
  Item* mine = malloc(count * sizeof *mine);
  memcpy(mine, items, count * sizeof *mine);
  *g = (Group){++s->next_id, (uint32_t)first, total, count, items[0].length, start_ns, mine,
               NULL};
  int fd = s->fd;
  pthread_mutex_unlock(&s->mu);
  /* The rows, each request's after the one before; the slots are this group's alone. A model
   * of several inputs has each input's `total` rows at the length one after another. */
  bool copied = true;
  uint32_t at = 0;
  for (uint32_t i = 0; i < count && copied; ++i) {
    uint32_t inputs = s->several ? s->n_inputs : 1;
    uint64_t region = (uint64_t)g->start * s->in_item_bytes;
    for (uint32_t k = 0; k < inputs && copied; ++k) {
      TRITONBACKEND_Input* input = NULL;
      const char* name;
      int datatype;
      const int64_t* shape;
      uint32_t dims = 0, buffers = 0;
      uint64_t bytes = 0, offset = 0;
      uint64_t item = s->several ? input_item_bytes(s, k, g->length ? g->length : 1) : 0;
      request_input(s, mine[i].request, k, &input);
      TRITONBACKEND_InputProperties(input, &name, &datatype, &shape, &dims, &bytes, &buffers);
      for (uint32_t b = 0; b < buffers; ++b) {
        const void* data = NULL;
        uint64_t size = 0;
        int memory_type = MEMORY_CPU;
        int64_t memory_id = 0;
        TRITONSERVER_Error* err = TRITONBACKEND_InputBuffer(input, b, &data, &size,
                                                            &memory_type, &memory_id);
        if (err || memory_type == MEMORY_GPU) {
          if (err) TRITONSERVER_ErrorDelete(err);
          copied = false;
          break;
        }
        if (s->several)
          memcpy(s->slab + region + (uint64_t)at * item + offset, data, size);
        else
          put_rows(s, g->start + at, offset, data, size);
        offset += size;
      }
      region += (uint64_t)total * item;
    }
    at += mine[i].items;
  }
  if (!copied) {
    fail_group(s, g, ERROR_INVALID_ARG,
               "an input in GPU memory (CUDA shared memory) is not read by the native backend: "
               "use system shared memory or none, or serve with --triton-backend python");
    release_group(s, g);
    return;
  }
  uint8_t descriptor[REQUEST_BYTES] = {0};
  uint16_t index = (uint16_t)s->index;
  uint32_t slot = g->start, length = g->length;
  memcpy(descriptor, &g->id, 8);
  memcpy(descriptor + 8, &index, 2);
  descriptor[10] = s->code;
  memcpy(descriptor + 12, &slot, 4);
  memcpy(descriptor + 16, &total, 4);
  memcpy(descriptor + 20, &length, 4);
  memcpy(descriptor + 24, &count, 4); /* the client requests it carries, for the counts */
  uint64_t id = g->id; /* once held, the group may be answered and freed by the reader */
  pthread_mutex_lock(&s->mu);
  Group** bucket = &s->groups[id % GROUP_BUCKETS];
  g->next = *bucket;
  *bucket = g;
  pthread_mutex_unlock(&s->mu);
  if (send_frame(s, fd, K_INFER, descriptor, REQUEST_BYTES, true) < 0) {
    /* The link ended: its reader answers every group still held (this one too, if it had
     * not yet); one it already passed is answered here. */
    finish_group(s, id, NULL, ERROR_UNAVAILABLE, "the infermux runtime closed its link: retry");
  }
}

TRITONSERVER_Error* TRITONBACKEND_ModelInstanceExecute(TRITONBACKEND_ModelInstance* instance,
                                                       TRITONBACKEND_Request** requests,
                                                       const uint32_t count) {
  void* state = NULL;
  TRITONSERVER_Error* err = TRITONBACKEND_ModelInstanceState(instance, &state);
  if (err) return err;
  Instance* s = state;
  uint64_t start_ns = now_ns();
  Item* items = calloc(count ? count : 1, sizeof *items);
  uint32_t kept = 0;
  for (uint32_t r = 0; r < count; ++r) {
    uint32_t n = 0, length = 0;
    const char* problem = check_request(s, requests[r], &n, &length);
    if (problem) {
      respond_error(s, requests[r], ERROR_INVALID_ARG, problem);
      continue;
    }
    items[kept++] = (Item){requests[r], n, length};
  }
  pthread_mutex_lock(&s->mu);
  if (kept && s->fd < 0 && (err = link_up(s)) != NULL) {
    pthread_mutex_unlock(&s->mu);
    const char* why = "the infermux runtime is not reachable";
    for (uint32_t i = 0; i < kept; ++i) respond_error(s, items[i].request, ERROR_UNAVAILABLE, why);
    TRITONSERVER_ErrorDelete(err);
    free(items);
    return NULL;
  }
  pthread_mutex_unlock(&s->mu);
  /* One descriptor per run of requests of one length (Triton batches requests of one shape,
   * so a batch is usually one run). */
  for (uint32_t i = 0; i < kept;) {
    uint32_t j = i, total = 0;
    while (j < kept && items[j].length == items[i].length) total += items[j++].items;
    submit(s, items + i, j - i, total, start_ns);
    i = j;
  }
  free(items);
  return NULL;
}
