/* reflection.h - gRPC server reflection (grpc.reflection.v1 and v1alpha)
 * from the descriptor set embedded at build time, so grpcurl and other
 * tools can list, describe and call moetraind without .proto files.
 *
 * The index is read from the serialized FileDescriptorProtos with a small
 * protobuf wire reader: file names, dependencies, and every symbol a client
 * may ask for (services, methods, messages, fields, oneofs, enums, enum
 * values, nested ones too).
 */
#ifndef MT_REFLECTION_H
#define MT_REFLECTION_H

#include <stddef.h>
#include <stdint.h>

typedef struct reflection reflection;

/* Indexes a FileDescriptorSet (the bytes must outlive the index). */
int reflection_create(reflection **out, const uint8_t *set, size_t len);
void reflection_destroy(reflection *r);

int reflection_n_files(const reflection *r);
/* Index of a file by name, or of the file declaring a symbol; -1 if none. */
int reflection_file_by_name(const reflection *r, const char *name);
int reflection_file_by_symbol(const reflection *r, const char *symbol);
/* Is `symbol` a message type? */
int reflection_is_message(const reflection *r, const char *symbol);

/* The file and its transitive dependencies (each once, the file first):
 * up to cap indices into out; returns the count. */
int reflection_closure(const reflection *r, int file, int *out, int cap);
/* Serialized FileDescriptorProto of file i. */
void reflection_file_bytes(const reflection *r, int i, const uint8_t **data, size_t *len);

/* The fully qualified service names, in file order. */
int reflection_n_services(const reflection *r);
const char *reflection_service(const reflection *r, int i);

#endif
