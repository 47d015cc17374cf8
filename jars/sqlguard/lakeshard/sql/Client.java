package lakeshard.sql;

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.ResultSet;
import java.sql.ResultSetMetaData;
import java.sql.SQLException;
import java.sql.Statement;

/**
 * A small JDBC client of the endpoint (`lakeshard sql`'s warm path, and the tests'):
 * `Client <jdbc-url> [limit]` reads statements from stdin, one per line (a newline inside
 * one written as backslash-n, a backslash as two), runs each over one connection,
 * and prints for each: `OK <columns>`, then one line per row (tab-separated, null as
 * \N, tabs/newlines/backslashes escaped), then `END <rows>`; or `ERROR <message>`.
 */
public final class Client {
    private Client() {}

    public static void main(String[] args) throws Exception {
        int limit = args.length > 1 ? Integer.parseInt(args[1]) : Integer.MAX_VALUE;
        Class.forName("org.apache.hive.jdbc.HiveDriver");
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        try (Connection conn = DriverManager.getConnection(args[0], "lakeshard", "")) {
            String line;
            while ((line = in.readLine()) != null) {
                if (!line.isBlank()) {
                    run(conn, unescape(line), limit);
                }
            }
        }
        System.out.flush();
    }

    private static void run(Connection conn, String sql, int limit) {
        StringBuilder out = new StringBuilder();
        try (Statement st = conn.createStatement()) {
            if (!st.execute(sql)) {
                out.append("OK\nEND 0\n");
            } else {
                try (ResultSet rs = st.getResultSet()) {
                    ResultSetMetaData md = rs.getMetaData();
                    out.append("OK");
                    for (int i = 1; i <= md.getColumnCount(); i++) {
                        out.append(i == 1 ? " " : "\t").append(escape(md.getColumnLabel(i)));
                    }
                    out.append('\n');
                    int rows = 0;
                    while (rows < limit && rs.next()) {
                        for (int i = 1; i <= md.getColumnCount(); i++) {
                            if (i > 1) {
                                out.append('\t');
                            }
                            Object v = rs.getObject(i);
                            out.append(v == null ? "\\N" : escape(String.valueOf(v)));
                        }
                        out.append('\n');
                        rows++;
                    }
                    out.append("END ").append(rows).append('\n');
                }
            }
        } catch (SQLException e) {
            out.setLength(0);
            out.append("ERROR ").append(escape(String.valueOf(e.getMessage()))).append('\n');
        }
        System.out.print(out);
    }

    private static String unescape(String s) {
        StringBuilder out = new StringBuilder(s.length());
        for (int i = 0; i < s.length(); i++) {
            char c = s.charAt(i);
            if (c == '\\' && i + 1 < s.length()) {
                char n = s.charAt(++i);
                out.append(n == 'n' ? '\n' : n);
            } else {
                out.append(c);
            }
        }
        return out.toString();
    }

    private static String escape(String s) {
        return s.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n");
    }
}
