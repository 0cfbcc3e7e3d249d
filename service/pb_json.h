/* pb_json.h - any protobuf-c message as JSON (proto3 JSON mapping names:
 * lowerCamelCase keys, enums by name, 64-bit integers as strings), from its
 * descriptor: `moetrain status --json` and friends print responses this
 * way without a field list of their own. */
#ifndef MT_PB_JSON_H
#define MT_PB_JSON_H

#include <jansson.h>
#include <protobuf-c/protobuf-c.h>

json_t *pb_to_json(const ProtobufCMessage *m);

#endif
