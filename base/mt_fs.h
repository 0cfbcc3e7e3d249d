/* mt_fs.h - file-system helpers for durable writes (temp file + fsync +
 * rename, then fsync of the directory) and directory creation. */
#ifndef MT_FS_H
#define MT_FS_H

/* mkdir -p: creates `dir` and missing parents (mode 0755). */
int mt_mkdir_p(const char *dir);
/* Creates the parent directories of a file path. */
int mt_mkdir_parent(const char *path);
/* fsync of a file or directory by path. */
int mt_fsync_path(const char *path);
/* fsync of the directory holding `path`. */
int mt_fsync_parent(const char *path);
/* The whole file as a NUL-terminated malloc'd string; NULL (errno set) if it
 * cannot be read. */
char *mt_read_text_file(const char *path);

#endif
